"""Beam search on the paged KV cache against transformers' ``generate(num_beams=W)``: beams fork with
shared full blocks and a copied partial block, through preemption and alongside ordinary requests."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.sampling_params import SamplingParamsError
from tests.helpers import VOCAB, save_tiny_model
from tests.test_engine import make_prompts

EOS = 162  # a token the tiny model picks often, so that beams end early and finished hypotheses compete


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = save_tiny_model("llama", tmp_path_factory.mktemp("llama-beams"))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = EOS
        (path / name).write_text(json.dumps(config))
    return path


def hf_beams(model, prompt, width, max_new_tokens, length_penalty, eos):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                         num_return_sequences=width, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                         eos_token_id=eos, pad_token_id=0, early_stopping=False, output_scores=True,
                         return_dict_in_generate=True)
    beams = []
    for seq in out.sequences[:, len(prompt):].tolist():
        if eos is not None and eos in seq:
            seq = seq[: seq.index(eos) + 1]
        beams.append(seq)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("width, length_penalty, ignore_eos, some_stop, overlap", [
    (2, 1.0, True, False, False), (3, 1.0, False, True, True), (4, 0.5, False, True, False),
    (3, 2.0, False, False, False)])
def test_beams_equal_transformers(llama_dir, width, length_penalty, ignore_eos, some_stop, overlap):
    """Four concurrent beam searches (prompts that end mid-block, so every fork copies a partial block)
    and a sampled request beside them, in a pool small enough to preempt: the beams, their order and
    their scores equal transformers' (also with steps overlapped and planned ahead, which beams pause)."""
    prompts = make_prompts(VOCAB, lens=[7, 20, 33, 12], seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    llm = LLM(str(llama_dir), max_model_len=128, num_kvcache_blocks=11, max_num_batched_tokens=32,
              overlap_steps=overlap, async_scheduling=overlap)
    params = SamplingParams(n=width, use_beam_search=True, max_tokens=20, length_penalty=length_penalty,
                            ignore_eos=ignore_eos)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[0]}],
                        [params] * len(prompts) + [sampled], use_tqdm=False)
    ended_early = 0
    for prompt, out in zip(prompts, outs):
        expected, _ = hf_beams(model, prompt, width, 20, length_penalty, None if ignore_eos else EOS)
        got = [c.token_ids for c in out.outputs]
        assert got == expected
        for choice in out.outputs:
            stopped = not ignore_eos and choice.token_ids[-1] == EOS
            assert choice.finish_reason == ("stop" if stopped else "length")
            ended_early += stopped
    assert (ended_early > 0) == some_stop  # hypotheses that ended with EOS won places (a short-favouring penalty)
    assert len(outs[-1].outputs[0].token_ids) == 40
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.pool.num_total_blocks


def test_an_aborted_beam_search_frees_its_beams(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128, num_kvcache_blocks=40)
    engine = llm.engine
    prompt = make_prompts(VOCAB, lens=[21], seed=6)[0]
    engine.add_request("beams", prompt, SamplingParams(n=3, use_beam_search=True, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        assert engine.step() == []  # nothing comes out before the search ends
    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 3  # its beams
    [out] = engine.abort_requests(["beams"])
    assert out.finished and out.finish_reason == "abort" and out.beams == []
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_total_blocks
    engine.check_invariants()


def test_beam_search_refuses_what_it_cannot_honour():
    for field, value in (("top_p", 0.5), ("presence_penalty", 0.5), ("logprobs", 2), ("stop", ["x"]),
                         ("length_penalty", float("inf"))):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(n=2, use_beam_search=True, **{field: value})
        assert info.value.param == field
