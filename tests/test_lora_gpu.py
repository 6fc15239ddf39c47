"""LoRA adapters on a CUDA GPU: the Triton shrink and expand kernels inside CUDA graphs (decode steps by token,
BGMV, and by slot, SGMV), against transformers + peft on the same GPU."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers import VOCAB, save_tiny_model
from tests.test_engine import make_prompts
from tests.test_lora import make_adapter

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gpu")
    base = save_tiny_model("llama", root / "base")
    adapters = [make_adapter(base, root / f"a{i}", seed=i + 1, r=r) for i, r in enumerate([8, 16, 4])]
    return base, [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]


def peft_on_cuda(base, adapter: LoRARequest | None, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype).cuda()
    return (peft.PeftModel.from_pretrained(model, adapter.lora_path) if adapter else model).eval()


@pytest.mark.parametrize("num_prompts", [4, 24], ids=["bgmv", "sgmv"])  # decode graphs of 4 rows, and of 24 rows
def test_adapters_under_cuda_graphs_match_peft_in_float32(model_and_adapters, num_prompts):
    """A batch mixing the base model and three adapters, in float32 with CUDA graphs and steps planned ahead: every
    prompt token's logprob and the greedy tokens of transformers + peft."""
    base, adapters = model_and_adapters
    prompts = make_prompts(VOCAB, lens=[(7 * i) % 60 + 5 for i in range(num_prompts)])
    lora = [([None] + adapters)[i % 4] for i in range(num_prompts)]
    llm = LLM(str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_model_len=256, num_kvcache_blocks=256, max_num_batched_tokens=64)
    assert llm.engine.runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
    assert llm.engine.runner.num_steps_by_kind["decode_graph"] > 0
    references = {a.lora_name if a else None: peft_on_cuda(base, a, torch.float32) for a in [None, *adapters]}
    for prompt, adapter, out in zip(prompts, lora, outs):
        model = references[adapter.lora_name if adapter else None]
        ids = torch.tensor([prompt]).cuda()
        with torch.no_grad():
            ref = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        expected = ref.gather(1, ids[0, 1:, None])[:, 0].cpu().tolist()
        assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(expected, abs=2e-3)
        assert out.outputs[0].token_ids == gen[0, len(prompt):].tolist()


def test_adapters_in_bfloat16_stay_within_tolerance_of_peft(model_and_adapters):
    """bfloat16 with CUDA graphs (the serving path): each adapter's prompt logprobs within 0.1 nats of transformers
    + peft in float32, on average within 0.02."""
    base, adapters = model_and_adapters
    prompts = make_prompts(VOCAB, lens=[40, 90, 17])
    llm = LLM(str(base), device="cuda", enable_lora=True, max_loras=3, max_lora_rank=16, max_model_len=256,
              num_kvcache_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    for adapter in adapters:
        model = peft_on_cuda(base, adapter, torch.float32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=adapter)
        errors = []
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt]).cuda()
            with torch.no_grad():
                ref = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            expected = ref.gather(1, ids[0, 1:, None])[:, 0].cpu()
            errors.append((torch.tensor([e.logprob for e in out.prompt_logprobs[1:]]) - expected).abs())
        errors = torch.cat(errors)
        assert errors.max() < 0.1 and errors.mean() < 0.02, (adapter.lora_name, errors.max(), errors.mean())
