"""Embedding throughput: minivllm's pooling runner against transformers on the same inputs, in one run.

    python bench/embedding_throughput.py                                  # Qwen3-Embedding-0.6B's shape (CUDA)
    python bench/embedding_throughput.py --batch-sizes 1 16 256 --num-inputs 512

The model is Qwen3-Embedding-0.6B's shape (Qwen3-0.6B's layers saved as a base ``Qwen3Model``, as the real
checkpoint is) with random bfloat16 weights, written once to a temporary directory so that both engines read the
same file. The inputs are random token ids of 32 to 512 tokens. For each batch size B the inputs go in calls of B
(``LLM.embed`` / one padded forward pass), one call after another, as a client sending B texts per request would;
tokens/s counts the inputs' tokens. The prefix cache is off, since every batch size embeds the same inputs. Before
timing, the first inputs' embeddings of both are compared (cosine similarity). Writes a JSON record to bench/out/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import MODEL_SHAPES  # noqa: E402

from engine import LLM, PoolingParams  # noqa: E402


def save_random_embedder(dtype: torch.dtype) -> Path:
    """Qwen3-Embedding-0.6B's layout: a base Qwen3Model whose config.json names the causal LM architecture."""
    import transformers

    shape = {k: v for k, v in MODEL_SHAPES["qwen3-0.6b"].items() if k not in ("architectures", "model_type")}
    config = transformers.Qwen3Config(**shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.Qwen3Model(config).to(dtype)
    path = Path(tempfile.mkdtemp(prefix="minivllm-qwen3-embedding-"))
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "architectures": ["Qwen3ForCausalLM"]}))
    return path


def make_inputs(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 513, (num,), generator=g).tolist()
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lens]


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class TransformersEmbedder:
    """One right-padded forward pass per call; each input's last real token's hidden state, L2-normalised."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str):
        import transformers

        self.device = device
        self.model = transformers.AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        self.model = self.model.to(device).eval()

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        longest = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, :len(p)] = torch.tensor(p)
            mask[row, :len(p)] = 1
        hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        last = mask.sum(dim=1).to(self.device) - 1
        return F.normalize(hidden[torch.arange(len(batch), device=self.device), last].float(), dim=-1)


def timed(fn, batches: list[list[list[int]]], sync) -> float:
    start = time.perf_counter()
    for batch in batches:
        fn(batch)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    path = save_random_embedder(dtype)
    inputs = make_inputs(args.num_inputs, MODEL_SHAPES["qwen3-0.6b"]["vocab_size"])
    num_tokens = sum(len(p) for p in inputs)
    print(f"{len(inputs)} inputs, {num_tokens} tokens; {torch.cuda.get_device_name() if on_cuda else 'CPU'}")

    llm = LLM(str(path), runner="pooling", enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024)
    ours = lambda batch: llm.embed([{"prompt_token_ids": p} for p in batch], PoolingParams(), use_tqdm=False)  # noqa: E731
    peer = TransformersEmbedder(path, dtype, device)

    check = inputs[:8]
    mine = torch.stack([torch.as_tensor(o.outputs.embedding, dtype=torch.float32) for o in ours(check)])
    theirs = peer.embed(check).cpu()
    cosine = F.cosine_similarity(mine, theirs, dim=-1)
    print(f"cosine similarity to transformers over {len(check)} inputs: min {cosine.min():.5f}")

    rows = []
    for size in args.batch_sizes:
        batches = chunks(inputs, size)
        timed(ours, batches[:2], sync), timed(peer.embed, batches[:2], sync)  # warm-up of this shape
        t_ours, t_peer = timed(ours, batches, sync), timed(peer.embed, batches, sync)
        row = {"batch_size": size, "minivllm_tok_s": num_tokens / t_ours, "transformers_tok_s": num_tokens / t_peer}
        row["ratio"] = row["minivllm_tok_s"] / row["transformers_tok_s"]
        rows.append(row)
        print(f"B={size:4d}  minivllm {row['minivllm_tok_s']:10.0f} tok/s  transformers "
              f"{row['transformers_tok_s']:10.0f} tok/s  ratio {row['ratio']:.2f}x", flush=True)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    record = {"device": torch.cuda.get_device_name() if on_cuda else "cpu", "num_inputs": len(inputs),
              "num_tokens": num_tokens, "min_cosine": float(cosine.min()), "rows": rows}
    (out / f"embedding_throughput_{int(time.time())}.json").write_text(json.dumps(record, indent=2))
    llm.engine.close()


if __name__ == "__main__":
    main()
