"""Triton paged attention against the torch reference backend.

On a machine without a GPU these run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
float32 tensors, which is slow: sizes are small but every context still spans many blocks.
Every case fills the whole cache with random values and scatters the block ids, so a read
through the wrong slot or past the end of a context changes the result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend, write_kv  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.ops.attention import (  # noqa: E402
    PagedAttention,
    choose_num_splits,
    compile_variants,
    paged_decode_attention,
    paged_prefill_attention,
    write_paged_kv,
)
from engine.ops.attention import decode as decode_module  # noqa: E402
from engine.ops.attention.decode import _launch_decode  # noqa: E402
from engine.ops.attention.kv_write import _launch_write  # noqa: E402
from engine.ops.attention.prefill import _launch_prefill  # noqa: E402
from kvcache.paged_cache import quantize_fp8, rotate_heads  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1 to test the kernels on the CPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(atol=1e-4, rtol=1e-4)
PAD = None  # a padding row of a CUDA-graph bucket: seq_len 0, its one token's slot in the null block


@dataclass
class Case:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], already holding k/v
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    padding_rows: list[int]  # token rows of seq_len-0 requests


def make_case(seed: int, reqs: list, num_kv_heads: int, group: int, head_dim: int, block_size: int) -> Case:
    """A batch of requests given as (num_cached, query_len) or PAD; decodes (query_len 1) must come first."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seq_lens = [0 if r is PAD else r[0] + r[1] for r in reqs]
    query_lens = [1 if r is PAD else r[1] for r in reqs]
    blocks_per_req = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_req) + 2  # spare columns: must never be read
    num_blocks = 1 + sum(blocks_per_req) + 4  # block 0 is the null block
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    # Unused table entries point at random real blocks, not the null block, so stray reads show.
    tables = torch.randint(1, num_blocks, (len(reqs), max_blocks), generator=gen, dtype=torch.int32)
    slots = []
    for i, (n, ql) in enumerate(zip(seq_lens, query_lens)):
        if n == 0:
            tables[i] = 0
            slots += [0] * ql
            continue
        ids = [free.pop() for _ in range(blocks_per_req[i])]
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n - ql, n)]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    num_decodes = sum(1 for ql in query_lens if ql == 1)
    assert all(ql == 1 for ql in query_lens[:num_decodes]), "decodes first"
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        num_reqs=len(reqs),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    k, v = k.to(DEVICE), v.to(DEVICE)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    padding_rows = [int(qsl[i]) for i, n in enumerate(seq_lens) if n == 0]
    return Case(q.to(DEVICE), k, v, k_cache, v_cache, meta, 1.0 / math.sqrt(head_dim), padding_rows)


def attend(backend, q, k, v, k_cache, v_cache, meta, scale, window=0, kv_scales=None, softcap=0.0, **kwargs):
    """One attention layer's step on ``backend``, its cache bound as ``Attention`` binds it."""
    layer = backend.bind(k_cache, v_cache, q.shape[1], scale, kv_scales, window, softcap)
    return backend.forward(layer, q, k, v, meta, **kwargs)


def reference(case: Case) -> torch.Tensor:
    # The torch backend writes k/v again (same values) into its own copy of the cache.
    return attend(TorchAttentionBackend(), case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(),
                  case.meta, case.scale)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, padding_rows: list[int]) -> None:
    assert torch.isfinite(out).all(), "every row must be written with finite values"
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[padding_rows] = False
    torch.testing.assert_close(out[keep.to(out.device)], ref[keep.to(ref.device)], **TOL)
    if padding_rows:
        assert (out[padding_rows] == 0).all(), "a seq_len 0 row must come out as zeros"


def run_decode(case: Case, num_splits: int | None) -> torch.Tensor:
    d = case.meta.num_decodes
    out = torch.full_like(case.q[:d], float("nan"))
    paged_decode_attention(case.q[:d], case.k_cache, case.v_cache, case.meta.block_tables[:d],
                           case.meta.seq_lens[:d], case.scale, out, num_splits)
    return out


def run_prefill(case: Case, first_req: int = 0) -> torch.Tensor:
    """The prefill kernel on requests first_req.. (all of them: the unified path)."""
    m, t0 = case.meta, int(case.meta.query_start_loc_cpu[first_req])
    out = torch.full_like(case.q[t0:], float("nan"))
    paged_prefill_attention(case.q[t0:], case.k_cache, case.v_cache, m.block_tables[first_req:],
                            m.query_start_loc[first_req:], m.seq_lens[first_req:], m.max_query_len, case.scale, out)
    return out


# Contexts end inside a block (or exactly on one); the longest spans 11 blocks of 32, 21 of 16.
DECODES = [(0, 1), (16, 1), (36, 1), (330, 1), (178, 1), (95, 1)]


@pytest.mark.parametrize(
    "group, head_dim, block_size, num_splits",
    [
        (1, 64, 16, 1),
        (4, 64, 16, 3),
        (8, 64, 32, 2),
        (4, 128, 16, 5),
        (1, 128, 32, 8),
        (8, 128, 16, None),
        (2, 32, 24, 4),  # blocks that do not divide the key tile: one table lookup per key
        (2, 256, 16, 2),
    ],
)
def test_decode_matches_reference(group, head_dim, block_size, num_splits):
    reqs = DECODES + [PAD]  # padding rows sit at the end of a graph bucket
    case = make_case(10 + group + head_dim + block_size, reqs, 2 if group < 8 else 1, group, head_dim, block_size)
    d = case.meta.num_decodes
    ref = reference(case)[:d]
    assert_matches(run_decode(case, num_splits), ref, case.padding_rows)


def test_decode_tiles_setting_sets_unsplit_tiles_and_refuses_bad_values(monkeypatch):
    """MINIVLLM_DECODE_TILES=BLOCK_N,warps,stages: unsplit contexts run with those tiles and give the same outputs;
    split ones keep theirs; a malformed value is refused, naming the setting."""
    case = make_case(33, DECODES + [PAD], 2, 2, 64, 16)
    d = case.meta.num_decodes
    ref = reference(case)[:d]
    seen = []
    original = decode_module._decode_tiles

    def spy(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(decode_module, "_decode_tiles", spy)
    monkeypatch.setenv("MINIVLLM_DECODE_TILES", "32,2,2")
    assert_matches(run_decode(case, 1), ref, case.padding_rows)
    assert_matches(run_decode(case, 2), ref, case.padding_rows)
    assert seen == [(32, 2, 2), (64, 4, 3)]
    for bad in ("128,4", "128,4,x", "100,4,3", "128,3,3", "128,4,0"):
        monkeypatch.setenv("MINIVLLM_DECODE_TILES", bad)
        with pytest.raises(ValueError, match="MINIVLLM_DECODE_TILES"):
            run_decode(case, 1)


def test_decode_kernel_gets_the_key_buffers_its_stages_ask_for_on_hopper():
    """Compiled for sm_90 as a launch specializes it (bench/kernel_resources.py, in a process of its own without the
    interpreter): three stages give the bf16 decode kernel two K/V buffers, two stages one. With each tile's block
    ids loaded in the loop, Triton's pipeliner gave one whatever the stages."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"), "--json",
                          "--decode-tiles", "128,4,2", "128,4,3", "--prefill-tiles"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(r["kernel"], tuple(r["tiles"])): r for r in json.loads(out.stdout)["rows"]}
    assert rows[("decode bf16", (128, 4, 2))]["buffers"] == 1
    assert rows[("decode bf16", (128, 4, 3))]["buffers"] == 2
    one, two = rows[("decode bf16", (128, 4, 2))], rows[("decode bf16", (128, 4, 3))]
    assert two["shared"] > one["shared"] + 60 * 1024  # a second 128 x 128 bf16 tile for K and for V
    assert one["picked"] and one["programs_per_sm"] >= 2


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_rows_in_any_layout_give_their_own_outputs(num_splits):
    """The model runner lays out each step's rows longest context first, so a request's row moves from step to
    step: laid out longest first or shuffled, each row gets the output it gets in place."""
    case = make_case(21, DECODES + [PAD, PAD], 2, 4, 64, 16)
    d, m = case.meta.num_decodes, case.meta
    ref = reference(case)[:d]
    longest_first = torch.argsort(m.seq_lens_cpu[:d], descending=True, stable=True)
    shuffled = torch.randperm(d, generator=torch.Generator().manual_seed(3))
    for perm in (longest_first, shuffled):
        rows = perm.to(DEVICE)
        out = torch.full_like(case.q[:d], float("nan"))
        paged_decode_attention(case.q[:d][rows].contiguous(), case.k_cache, case.v_cache,
                               m.block_tables[:d][rows].contiguous(), m.seq_lens[:d][rows].contiguous(), case.scale,
                               out, num_splits)
        padding = [i for i, r in enumerate(perm.tolist()) if r in case.padding_rows]
        assert_matches(out, ref[perm.to(ref.device)], padding)


@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (1, 128), (3, 32)])
def test_write_paged_kv_matches_indexed_copy(num_kv_heads, head_dim):
    """One kernel stores K and V rows, including rows that are views into a fused qkv tensor."""
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks, block_size, n = 9, 16, 37
    cache = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2)]
    cache += [c.clone() for c in cache]
    row = num_kv_heads * head_dim
    qkv = torch.randn(n + 3, 2 * row + row, generator=gen).to(DEVICE)  # padded rows past the slots
    k = qkv[:, row:2 * row].view(n + 3, num_kv_heads, head_dim)
    v = qkv[:, 2 * row:].view(n + 3, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(DEVICE)
    write_kv(cache[0], cache[1], k[:n], v[:n], slots)
    write_paged_kv(k, v, cache[2], cache[3], slots)
    assert torch.equal(cache[0], cache[2]) and torch.equal(cache[1], cache[3])
    before = cache[2].clone()
    skipped = slots.clone()
    skipped[::2] = -1  # negative slots are skipped
    write_paged_kv(k + 1, v + 1, cache[2], cache[3], skipped)
    changed = (cache[2] != before).any(-1).any(-1).view(-1).nonzero().view(-1)
    assert sorted(changed.tolist()) == sorted(slots[1::2].tolist())


def test_write_paged_kv_rejects_bad_inputs():
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    k = torch.zeros(5, 2, 64, device=DEVICE)
    slots = torch.arange(5, device=DEVICE)
    write_paged_kv(k, k, cache, cache.clone(), slots)
    bad = [
        (k[:, :1], k, cache, cache, slots),  # wrong head count
        (k.half(), k, cache, cache, slots),  # dtype
        (k.transpose(1, 2).contiguous().transpose(1, 2), k, cache, cache, slots),  # rows not contiguous
        (k, k, cache, cache[:, :8], slots),  # cache shapes differ
        (k, k, cache, cache, slots.int()),  # slot dtype
        (k[:3], k[:3], cache, cache, slots),  # fewer rows than slots
    ]
    for args in bad:
        with pytest.raises(ValueError):
            write_paged_kv(*args)


def test_decode_splits_agree_including_empty_splits():
    # 32 splits of a 3-tile context: most splits are empty and must drop out of the merge.
    case = make_case(7, [(2, 1), (150, 1), PAD], 2, 2, 64, 16)
    ref = reference(case)
    for num_splits in (1, 4, 32):
        assert_matches(run_decode(case, num_splits), ref, case.padding_rows)


MIXED = [(40, 1), (7, 1), (48, 16), (37, 50), (0, 70), (130, 9)]  # decodes, prefix hits, chunks, a fresh prompt


@pytest.mark.parametrize(
    "group, head_dim, block_size",
    [(1, 64, 16), (4, 128, 32), (8, 64, 16), (4, 64, 32), (2, 32, 16), (2, 256, 32)],
)
def test_prefill_matches_reference(group, head_dim, block_size):
    case = make_case(100 + group + head_dim + block_size, MIXED, 2 if group < 8 else 1, group, head_dim, block_size)
    d = case.meta.num_decodes
    ref = reference(case)
    assert_matches(run_prefill(case, first_req=d), ref[d:], [])


@pytest.mark.parametrize("tiles", [(16, 16, 4, 2), (64, 128, 4, 2), (128, 32, 8, 3)])
def test_prefill_tile_shapes_agree(tiles):
    """Any tile shape a sweep may pick (rows, keys per tile) gives the reference's result: the tiles every row sees
    whole, the diagonal ones, the chunks with cached context."""
    case = make_case(11, MIXED + [(0, 300)], 2, 2, 64, 16)
    m = case.meta
    out = torch.full_like(case.q, float("nan"))
    _launch_prefill(case.q, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                    m.max_query_len, case.scale, out, tiles=tiles)
    assert_matches(out, reference(case), [])


def test_prefill_kernel_serves_whole_mixed_batch():
    case = make_case(3, MIXED, 2, 4, 64, 16)
    assert_matches(run_prefill(case), reference(case), [])


def test_prefill_odd_query_lengths():
    # Query lengths 1 next to longer ones, requests with no new tokens, a one-token prompt, one-block contexts.
    case = make_case(5, [(0, 1), (3, 1), (0, 2), (40, 0), (5, 3), (0, 0), (1, 17)], 1, 4, 32, 16)
    assert_matches(run_prefill(case), reference(case), [])


def test_half_precision():
    # bfloat16 needs a GPU (the interpreter's bfloat16 dot is not exact); float16 runs everywhere.
    case = make_case(4, [(90, 1), PAD, (37, 50)], 2, 4, 64, 16)
    half = Case(case.q.half(), case.k.half(), case.v.half(), case.k_cache.half(), case.v_cache.half(),
                case.meta, case.scale, case.padding_rows)
    as_float = Case(half.q.float(), half.k.float(), half.v.float(), half.k_cache.float(), half.v_cache.float(),
                    case.meta, case.scale, case.padding_rows)
    ref = reference(as_float)
    d = case.meta.num_decodes
    for out, expected, pad in ((run_decode(half, 2), ref[:d], case.padding_rows), (run_prefill(half, d), ref[d:], [])):
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        keep = [i for i in range(out.shape[0]) if i not in pad]
        torch.testing.assert_close(out[keep].float(), expected[keep], atol=3e-3, rtol=3e-3)


def test_backend_mixed_batch():
    case = make_case(11, MIXED, 1, 8, 128, 16)
    out = attend(TritonAttentionBackend(), case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_matches(out, reference(case), [])


def test_backend_decode_only_with_padding_rows():
    case = make_case(12, [(61, 1), (200, 1), PAD, PAD], 2, 4, 64, 16)
    out = attend(TritonAttentionBackend(), case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_matches(out, reference(case), case.padding_rows)


def as_captured(case: Case, extra_tokens: int, extra_reqs: int, seed: int) -> tuple[Case, int]:
    """The case laid out as a mixed step's CUDA graph sees it (engine/worker/cuda_graphs.py, ``MixedGraphs``): padding
    tokens past the last request's (slot 0), padding requests with no tokens whose table rows hold stale block ids,
    no host-side count of decodes, and each row's decode length on the device. Returns it and the real token count."""
    gen = torch.Generator().manual_seed(seed)
    m = case.meta
    n, r = m.slot_mapping.shape[0], m.num_reqs
    nb = case.k_cache.shape[0]

    def pad(x):
        return torch.cat([x, torch.randn((extra_tokens, *x.shape[1:]), generator=gen).to(x)])

    qsl = torch.cat([m.query_start_loc_cpu, torch.full((extra_reqs,), n, dtype=torch.int32)])
    seq_lens = torch.cat([m.seq_lens_cpu, torch.zeros(extra_reqs, dtype=torch.int32)])
    stale = torch.randint(1, nb, (extra_reqs, m.block_tables.shape[1]), generator=gen, dtype=torch.int32)
    decode_lens = torch.where(qsl.diff() == 1, seq_lens, 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([m.slot_mapping, torch.zeros(extra_tokens, dtype=torch.int64, device=DEVICE)]),
        query_start_loc=qsl.to(DEVICE), seq_lens=seq_lens.to(DEVICE),
        block_tables=torch.cat([m.block_tables, stale.to(DEVICE)]),
        num_reqs=r + extra_reqs, num_decodes=0, num_decode_tokens=0, max_query_len=n + extra_tokens,
        max_seq_len=m.max_seq_len, block_size=m.block_size, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        decode_seq_lens=decode_lens.to(DEVICE),
    )
    return Case(pad(case.q), pad(case.k), pad(case.v), case.k_cache, case.v_cache, meta, case.scale, []), n


@pytest.mark.parametrize("extra_tokens, extra_reqs", [(0, 0), (13, 4), (40, 40)])
def test_mixed_step_as_captured_matches_the_step_itself(extra_tokens, extra_reqs):
    """Both backends give a mixed step laid out as its CUDA graph sees it the outputs of the step itself (the
    decode kernel with splits included), and zeros in the padding tokens' rows, which the Triton backend fills
    after the decode kernel wrote zeros over some prefill tokens' rows."""
    case = make_case(21, [(330, 1), (95, 1), (16, 1)] + MIXED[2:], 2, 4, 64, 16)
    ref = reference(case)
    captured, n = as_captured(case, extra_tokens, extra_reqs, 22)
    assert captured.q.shape[0] >= captured.meta.num_reqs  # the decode kernel reads one token a row
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        k_cache, v_cache = captured.k_cache.clone(), captured.v_cache.clone()
        out = attend(backend, captured.q, captured.k, captured.v, k_cache, v_cache, captured.meta, captured.scale)
        torch.testing.assert_close(out[:n], ref, **TOL)
        assert (out[n:] == 0).all(), backend.name


def test_prefill_kernel_can_leave_decodes_alone():
    case = make_case(23, MIXED, 2, 4, 64, 16)
    m = case.meta
    out = torch.full_like(case.q, float("nan"))
    paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                            m.max_query_len, case.scale, out, skip_single=True)
    d = m.num_decodes
    assert out[:d].isnan().all(), "the rows of one-token requests are not written"
    torch.testing.assert_close(out[d:], reference(case)[d:], **TOL)


def test_compile_variants_covers_every_split_count_and_tile_height():
    cache = torch.zeros(3, 16, 2, 64, device=DEVICE)
    table = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    # 6 split counts (1..32) and prefill tiles of 16, 32 and 64 rows (group 2: 1-8, 16 and 32+ tokens).
    assert compile_variants(4, cache, cache, table, 8192) == 6 + 3
    assert compile_variants(4, cache, cache, table, 4) == 6 + 1


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 4096, 132) == 1  # plenty of programs already
    assert choose_num_splits(1, 8, 4096, 132) == 32  # 264 / 8 wanted, capped at MAX_NUM_SPLITS
    assert choose_num_splits(4, 8, 512, 132) == 8  # one piece per 64 keys at most
    assert choose_num_splits(1, 8, 100, 132) == 1  # too short to be worth cutting
    assert choose_num_splits(16, 8, 4096, 132) == 4
    for b in (1, 3, 17, 100):
        n = choose_num_splits(b, 2, 2048, 132)
        assert n >= 1 and n & (n - 1) == 0


def _bad_decode_calls(case: Case):
    """(description, kwargs overriding a valid paged_decode_attention call)."""
    d = case.meta.num_decodes
    q, out = case.q[:d], torch.empty_like(case.q[:d])
    good = dict(q=q, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=case.meta.block_tables[:d],
                seq_lens=case.meta.seq_lens[:d], scale=case.scale, out=out, num_splits=2)
    bad = [
        ("q rank", dict(q=q[0])),
        ("q dtype", dict(q=q.double(), out=out.double())),
        ("cache dtype", dict(k_cache=case.k_cache.half())),
        ("cache shapes differ", dict(v_cache=case.v_cache[:, :, :, :32])),
        ("head_dim", dict(q=q[:, :, :48], out=out[:, :, :48], k_cache=case.k_cache[..., :48].contiguous(),
                          v_cache=case.v_cache[..., :48].contiguous())),
        ("heads not a multiple", dict(q=q[:, :3], out=out[:, :3])),
        ("out shape", dict(out=out[:1])),
        ("table dtype", dict(block_tables=case.meta.block_tables[:d].long())),
        ("seq_lens dtype", dict(seq_lens=case.meta.seq_lens[:d].long())),
        ("seq_lens shape", dict(seq_lens=case.meta.seq_lens[:1])),
        ("table rows", dict(block_tables=case.meta.block_tables[:1], seq_lens=case.meta.seq_lens[:1])),
        ("q strides", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("num_splits", dict(num_splits=0)),
        ("scale", dict(scale=float("nan"))),
    ]
    return good, bad


def test_decode_rejects_bad_inputs():
    case = make_case(1, [(20, 1), (33, 1)], 2, 2, 64, 16)
    good, bad = _bad_decode_calls(case)
    paged_decode_attention(**good)
    for what, change in bad:
        with pytest.raises(ValueError):
            paged_decode_attention(**{**good, **change})
            pytest.fail(f"accepted bad input: {what}")


def test_prefill_rejects_bad_inputs():
    case = make_case(2, [(0, 5), (10, 3)], 2, 2, 64, 16)
    m = case.meta
    good = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=m.block_tables,
                query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, max_query_len=m.max_query_len,
                scale=case.scale, out=torch.empty_like(case.q))
    paged_prefill_attention(**good)
    bad = [
        dict(query_start_loc=m.query_start_loc.long()),
        dict(query_start_loc=m.query_start_loc[:-1]),
        dict(max_query_len=-1),
        dict(out=torch.empty_like(case.q).half()),
        dict(k_cache=case.k_cache.transpose(2, 3).contiguous().transpose(2, 3)),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            paged_prefill_attention(**{**good, **change})


def test_binding_a_layer_checks_its_cache_and_configuration_once():
    """What the Triton backend binds to each attention layer (``PagedAttention``) refuses, when it is bound, what the
    kernels cannot take, naming it; an ``Attention`` layer binds when it has both its cache and its backend. A bound
    layer's launches, which check nothing more, give the one-shot functions' outputs."""
    from engine.attention.layer import Attention

    case = make_case(3, [(20, 1), (33, 1), (7, 9)], 2, 2, 64, 16)
    cache, m = case.k_cache, case.meta
    fp8 = torch.zeros(cache.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    scales = tuple(torch.ones(cache.shape[:3], device=DEVICE) for _ in range(2))
    odd = torch.zeros(*cache.shape[:3], 65, dtype=fp8.dtype, device=DEVICE)[..., :64]
    narrow = cache[..., :48].contiguous()
    _, _, _, _, pending = _qkv_case(3, 1, 4, 2, 32, torch.float32, "rope")  # a rope table 32 wide
    good = dict(k_cache=cache, v_cache=cache.clone(), num_heads=4, scale=case.scale)
    bad = {
        "caches of two shapes": (dict(v_cache=cache[:, :8]), "must both be"),
        "head size": (dict(k_cache=narrow, v_cache=narrow.clone()), "head_dim 48 is not supported"),
        "heads": (dict(num_heads=3), "multiple of num_kv_heads"),
        "a cache not contiguous": (dict(k_cache=cache.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        "FP8 scales' dtype": (dict(k_cache=fp8, v_cache=fp8.clone(), kv_scales=(scales[0].double(), scales[1])),
                              "kv_scales must be"),
        "odd FP8 strides": (dict(k_cache=odd, v_cache=odd, kv_scales=scales), "strides must be even"),
        "scale": (dict(scale=0.0), "scale must be"),
        "window": (dict(window=-1), "window"),
        "soft cap": (dict(softcap=float("inf")), "softcap"),
        "rope table": (dict(rope=pending), "cos_sin_cache must be"),
    }
    for what, (change, error) in bad.items():
        with pytest.raises(ValueError, match=error):
            PagedAttention(**{**good, **change})
            pytest.fail(f"bound: {what}")
    layer = Attention(4, 48, 2, case.scale, layer_idx=0)
    layer.set_backend(TritonAttentionBackend())
    with pytest.raises(ValueError, match="head_dim 48"):
        layer.bind_kv_cache(narrow, narrow.clone())
    bound = PagedAttention(**good)
    d = m.num_decodes
    for num_splits in (1, 2):
        ours, theirs = torch.full_like(case.q[:d], float("nan")), torch.full_like(case.q[:d], float("nan"))
        bound.decode(case.q[:d], m.block_tables[:d], m.seq_lens[:d], ours, num_splits)
        paged_decode_attention(case.q[:d], cache, good["v_cache"], m.block_tables[:d], m.seq_lens[:d], case.scale,
                               theirs, num_splits)
        assert torch.equal(ours, theirs)
    ours, theirs = torch.full_like(case.q, float("nan")), torch.full_like(case.q, float("nan"))
    bound.prefill(case.q, m.block_tables, m.query_start_loc, m.seq_lens, m.max_query_len, ours)
    paged_prefill_attention(case.q, cache, good["v_cache"], m.block_tables, m.query_start_loc, m.seq_lens,
                            m.max_query_len, case.scale, theirs)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("window", [1, 16, 37])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_matches_reference(window, num_splits):
    """A window shorter than most contexts: decode rows start from the window's first block (split over
    what remains), prefill tiles from the earliest key their first query still sees; rows of a tile that
    see nothing in its first key tiles stay finite."""
    case = make_case(21 + window, MIXED, 2, 4, 64, 16)
    ref = attend(TorchAttentionBackend(), case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(),
                 case.meta, case.scale, window)
    d, m = case.meta.num_decodes, case.meta
    out = torch.full_like(case.q[:d], float("nan"))
    paged_decode_attention(case.q[:d], case.k_cache, case.v_cache, m.block_tables[:d], m.seq_lens[:d], case.scale,
                           out, num_splits, window=window)
    assert_matches(out, ref[:d], [])
    prefill = torch.full_like(case.q, float("nan"))
    paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                            m.max_query_len, case.scale, prefill, window=window)
    assert_matches(prefill, ref, [])


# --------------------------------------------------------------------------------------------
# FP8 caches: float8_e4m3 K/V with a float32 scale per (token, KV head)
# --------------------------------------------------------------------------------------------


def fp8_case(case: Case) -> tuple[Case, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(``case`` with its whole cache quantized the way ``write_kv`` quantizes new tokens, K rotated; its scales;
    the queries rotated alike, which is what the kernels read that cache with)."""
    caches, scales = [], []
    for cache in (case.k_cache, case.v_cache):
        values, row_scales = quantize_fp8(rotate_heads(cache.flatten(0, 1)) if cache is case.k_cache
                                          else cache.flatten(0, 1))
        caches.append(values.view(cache.shape))
        scales.append(row_scales.view(cache.shape[:3]).contiguous())
    quantized = Case(case.q, case.k, case.v, caches[0], caches[1], case.meta, case.scale, case.padding_rows)
    return quantized, tuple(scales), rotate_heads(case.q).to(case.q.dtype)


def fp8_reference(case: Case, kv_scales, window: int = 0) -> torch.Tensor:
    return attend(TorchAttentionBackend(), case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(),
                  case.meta, case.scale, window, tuple(s.clone() for s in kv_scales))


@pytest.mark.parametrize("group, head_dim, num_splits, window, block_size",
                         [(1, 64, 1, 0, 16), (4, 128, 3, 0, 16), (8, 64, 2, 37, 16), (2, 32, 1, 20, 24)])
def test_fp8_cache_decode_and_prefill_match_reference(group, head_dim, num_splits, window, block_size):
    """Both kernels read float8 K/V, dequantize in registers and apply the scales to the score and probability
    columns: the same result as the torch backend's dequantize-then-attend, and within FP8's rounding of the
    unquantized attention."""
    dense = make_case(40 + group, MIXED, 2, group, head_dim, block_size)
    case, kv_scales, q = fp8_case(dense)
    ref = fp8_reference(case, kv_scales, window)
    d, m = case.meta.num_decodes, case.meta
    out = torch.full_like(q[:d], float("nan"))
    paged_decode_attention(q[:d], case.k_cache, case.v_cache, m.block_tables[:d], m.seq_lens[:d], case.scale,
                           out, num_splits, window=window, kv_scales=kv_scales)
    assert_matches(out, ref[:d], [])
    prefill = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                            m.max_query_len, case.scale, prefill, window=window, kv_scales=kv_scales)
    assert_matches(prefill, ref, [])
    exact = attend(TorchAttentionBackend(), dense.q, dense.k, dense.v, dense.k_cache.clone(), dense.v_cache.clone(),
                   dense.meta, dense.scale, window)
    error = (prefill - exact).abs()
    assert 0 < error.mean() < 0.02 and error.max() < 0.25, \
        f"FP8 attention is {error.mean()} (mean) and {error.max()} (max) from the exact one (unit-variance K/V)"


def test_fp8_decode_splits_agree_including_empty_splits():
    """The FP8 decode kernel's splits: contexts of 1-3 key tiles cut into 1, 3 or 32 pieces (whole tiles, a partial
    last one, empty pieces that must drop out of the merge) give the torch backend's result."""
    case, kv_scales, q = fp8_case(make_case(9, [(300, 1), (250, 1), (2, 1), PAD], 2, 2, 64, 16))
    ref = fp8_reference(case, kv_scales)
    m = case.meta
    for num_splits in (1, 3, 32):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale, out,
                               num_splits, kv_scales=kv_scales)
        assert_matches(out, ref, case.padding_rows)


def test_fp8_decode_ignores_nan_in_slots_past_the_context():
    """The FP8 decode kernel reads K without masks: slots past a context (the rest of its last block, block 0
    behind the table's padding) may hold anything, NaN bytes and NaN scales included, and must not reach the
    output. (Triton's interpreter reads the byte 0x7F as 480, not NaN: there the scales carry the test.)"""
    case, kv_scales, q = fp8_case(make_case(13, [(37, 1), (130, 1), (5, 1), PAD], 2, 2, 64, 16))
    ref = fp8_reference(case, kv_scales)
    m, block = case.meta, case.k_cache.shape[1]
    used = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for row, length in enumerate(m.seq_lens.tolist()):
        for pos in range(length):
            used[m.block_tables[row, pos // block], pos % block] = True
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    scales = tuple(s.clone() for s in kv_scales)
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8)[~used] = 0x7F  # float8_e4m3fn's NaN
    for s in scales:
        s[~used] = float("nan")
    for num_splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, m.block_tables, m.seq_lens, case.scale, out, num_splits,
                               kv_scales=scales)
        assert_matches(out, ref, case.padding_rows)


@pytest.mark.parametrize("group, num_kv_heads", [(4, 2), (2, 4), (8, 4)])
def test_fp8_decode_reads_several_kv_heads_in_one_program(group, num_kv_heads):
    """Two KV heads a program (their query heads stacked in the rows one dot pads to 16), unsplit and split, give
    the torch backend's result and the one-KV-head programs' output; more than fit the rows are refused."""
    case, kv_scales, q = fp8_case(make_case(15, MIXED, num_kv_heads, group, 64, 16))
    ref = fp8_reference(case, kv_scales)
    d, m = case.meta.num_decodes, case.meta
    for num_splits in (1, 2):
        outs = []
        for kv_heads in (1, 2):
            out = torch.full_like(q[:d], float("nan"))
            _launch_decode(q[:d], case.k_cache, case.v_cache, m.block_tables[:d], m.seq_lens[:d], case.scale, out,
                           num_splits, kv_scales=kv_scales, tiles=(128, 4, 2, None, kv_heads))
            assert_matches(out, ref[:d], [])
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    # Twice the KV heads there are, or (8 query heads a KV head) all four: 32 rows where a dot has 16.
    too_many = num_kv_heads if group * num_kv_heads > 16 else num_kv_heads * 2
    with pytest.raises(ValueError, match="KV heads per program"):
        _launch_decode(q[:d], case.k_cache, case.v_cache, m.block_tables[:d], m.seq_lens[:d], case.scale,
                       torch.empty_like(q[:d]), 1, kv_scales=kv_scales, tiles=(128, 4, 2, None, too_many))


def test_fp8_decode_rejects_odd_cache_strides():
    """The FP8 decode kernel reads the caches as 16-bit words: a cache view with an odd stride is refused."""
    case, kv_scales, q = fp8_case(make_case(14, [(20, 1)], 2, 2, 64, 16))
    wide = torch.zeros(*case.k_cache.shape[:3], 65, dtype=case.k_cache.dtype)
    odd = wide[..., :64]  # head dims contiguous, every other stride a multiple of 65
    m = case.meta
    with pytest.raises(ValueError, match="strides must be even"):
        paged_decode_attention(q, odd, odd, m.block_tables, m.seq_lens, case.scale, torch.empty_like(q), 1,
                               kv_scales=kv_scales)


@pytest.mark.parametrize("fp8_cache, dtype, reqs, num_splits", [
    (False, torch.float32, DECODES + [PAD], 2),
    (True, torch.float32, DECODES, 3),
    (False, torch.float16, DECODES, 3),
    (True, torch.float16, [(300, 1), (2, 1), PAD], 32),
] + ([(False, torch.bfloat16, DECODES + [PAD], 2), (True, torch.bfloat16, DECODES + [PAD], 4)] if DEVICE == "cuda"
     else []))
def test_decode_writes_its_output_quantized_as_the_next_projection_takes_it(fp8_cache, dtype, reqs, num_splits):
    """With ``fp8_out`` the decode kernels' merge (either cache) writes the output as an FP8 projection's input,
    one scale per token and head of 128: bit for bit what ``fp8_kernels.quantize_rows`` makes of the plain
    output in cuBLAS's layout, rows padded to 4 with zeros. Unsplit contexts refuse it."""
    from engine.ops.fp8 import empty_quantized, quantize_rows

    case = make_case(70 + num_splits, reqs, 2, 2, 128, 16)
    q, kw = case.q.to(dtype), {}
    if fp8_cache:
        case, kv_scales, q = fp8_case(case)
        q, kw = q.to(dtype), {"kv_scales": kv_scales}
    else:
        case.k_cache, case.v_cache = case.k_cache.to(dtype), case.v_cache.to(dtype)
    m, rows = case.meta, q.shape[0]
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale, out, num_splits,
                           **kw)
    want_values, want_scales = quantize_rows(out.view(rows, -1), 128, cublas_layout=True)
    values, scales = empty_quantized(rows, out[0].numel(), 128, q.device, cublas_layout=True)
    assert values.shape[0] > rows  # padding rows to fill
    values.view(torch.uint8).fill_(0x7F)  # NaN bytes and scales: everything must be written
    scales.fill_(float("nan"))
    unwritten = torch.full_like(q, float("nan"))
    paged_decode_attention(q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale, unwritten,
                           num_splits, fp8_out=(values, scales), **kw)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert unwritten.isnan().all(), "the quantized output replaces the plain one"
    with pytest.raises(ValueError, match="split contexts"):
        paged_decode_attention(q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale, unwritten, 1,
                               fp8_out=(values, scales), **kw)


def test_backend_quantizes_the_output_of_decode_only_steps_with_128_wide_heads():
    """``fp8_out``: a decode-only step of a few rows (contexts split) comes back quantized (the plain output's
    quantize_rows); a mixed step, 64-wide heads and a batch too large to split come back plain."""
    from engine.ops.fp8 import quantize_rows

    case = make_case(15, [(61, 1), (200, 1), (7, 1), PAD], 2, 4, 128, 16)
    backend = TritonAttentionBackend()
    args = (backend, case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    plain = attend(*args)
    values, scales = attend(*args, fp8_out=True)
    want_values, want_scales = quantize_rows(plain.view(4, -1), 128, cublas_layout=True)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(scales, want_scales)
    many = make_case(16, [(5 + i, 1) for i in range(40)], 8, 1, 128, 16)  # 320 programs unsplit on <= 132 SMs
    for case in (make_case(11, MIXED, 1, 8, 128, 16), make_case(12, [(61, 1), PAD], 2, 4, 64, 16), many):
        out = attend(backend, case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, fp8_out=True)
        assert_matches(out, reference(case), case.padding_rows)


# bfloat16 needs a GPU (the interpreter's bfloat16 dot is not exact).
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("group, head_dim, num_splits", [(2, 128, 1), (4, 64, 3)])
def test_fp8_cache_in_half_precision(dtype, group, head_dim, num_splits):
    """16-bit queries on an FP8 cache: both kernels' float16 dots (on a GPU of sm_89 or later the decode kernel
    converts in inline PTX) give their float32 result on the same cache (checked against the torch backend
    above) within half precision's rounding, with V rows whose scales span four decades."""
    dense = make_case(60 + group, MIXED, 2, group, head_dim, 16)
    dense.v_cache.mul_(torch.logspace(-3, 1, dense.v_cache.shape[1], device=DEVICE)[None, :, None, None])
    case, kv_scales, q_rotated = fp8_case(dense)
    d, m = case.meta.num_decodes, case.meta
    for q in (q_rotated, q_rotated.to(dtype)):  # float32 first: the reference
        decode = torch.full_like(q[:d], float("nan"))
        paged_decode_attention(q[:d], case.k_cache, case.v_cache, m.block_tables[:d], m.seq_lens[:d], case.scale,
                               decode, num_splits, kv_scales=kv_scales)
        prefill = torch.full_like(q, float("nan"))
        paged_prefill_attention(q, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                                m.max_query_len, case.scale, prefill, kv_scales=kv_scales)
        if q.dtype == torch.float32:
            ref_decode, ref_prefill = decode, prefill
    assert decode.dtype == prefill.dtype == dtype
    torch.testing.assert_close(decode.float(), ref_decode, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(prefill.float(), ref_prefill, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens_per_program, split_queries", [(None, None), (1, False), (4, True), (16, False),
                                                               (16, True)])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 64), (3, 32), (8, 128)])
def test_write_paged_kv_fp8_matches_reference(num_kv_heads, head_dim, tokens_per_program, split_queries):
    """The write kernel quantizes each head's row as ``write_kv`` does (K rotated first): the same float8 bytes
    and scales, in the slots named (negative slots skipped), and nothing else touched; the queries come back
    rotated as K was. However many tokens one program takes (21 tokens: the last program's are partly past the
    end), and whether the queries are rotated in programs of their own or beside K."""
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_blocks, block_size, n = 6, 16, 21
    k = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * 3).to(DEVICE)
    v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) / 50).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size - block_size, generator=gen)[:n] + block_size
    slots[3] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ours = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    ours_scales = tuple(torch.ones(shape[:3], device=DEVICE) for _ in range(2))
    q = torch.randn(n + 3, 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE)  # 3 padding rows past the slots
    q_rotated = _launch_write(k, v, ours[0], ours[1], slots, ours_scales, q=q, tokens_per_program=tokens_per_program,
                              split_queries=split_queries)
    torch.testing.assert_close(q_rotated, rotate_heads(q), atol=1e-5, rtol=1e-5)  # every row, padding included
    theirs = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    theirs_scales = tuple(torch.ones(shape[:3], device=DEVICE) for _ in range(2))
    keep = slots >= 0
    write_kv(theirs[0], theirs[1], k[keep], v[keep], slots[keep], theirs_scales)
    for name, a, b in zip("KV", ours, theirs):
        a, b = a.float(), b.float()
        if name == "K":
            # K is rotated before it is rounded: a different order of the rotation's float32 sums may put a
            # value that sits on a rounding boundary one float8 step away.
            step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2**-6))) - 3)
            near = (a - b).abs() <= step
            assert near.all() and (a != b).float().mean() < 0.01, (a[~near], b[~near])
            a = torch.where(near, b, a)
        assert torch.equal(a, b), (a[a != b], b[a != b])
    for a, b in zip(ours_scales, theirs_scales):
        torch.testing.assert_close(a, b, atol=0, rtol=1e-6)
    assert float(ours_scales[0].view(-1, num_kv_heads)[slots[0]].max()) > 0.001  # written, not the initial ones
    with pytest.raises(ValueError):
        write_paged_kv(k, v, ours[0], ours[1], slots, (ours_scales[0].double(), ours_scales[1]))


@pytest.mark.parametrize("window", [0, 37])
def test_soft_capped_scores_match_reference(window):
    """Gemma 2's attention soft-capping (scores become 5 * tanh(scores / 5)) in both kernels, with and without a
    window, equals the torch backend's capped attention; the cap changes the result."""
    case = make_case(61 + window, MIXED, 2, 4, 64, 16)
    case = Case(case.q * 4, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, case.padding_rows)
    ref = attend(TorchAttentionBackend(), case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(),
                 case.meta, case.scale, window, None, 5.0)
    uncapped = attend(TorchAttentionBackend(), case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(),
                      case.meta, case.scale, window)
    assert (ref - uncapped).abs().max() > 0.05
    d, m = case.meta.num_decodes, case.meta
    out = torch.full_like(case.q[:d], float("nan"))
    paged_decode_attention(case.q[:d], case.k_cache, case.v_cache, m.block_tables[:d], m.seq_lens[:d], case.scale,
                           out, 3, window=window, softcap=5.0)
    assert_matches(out, ref[:d], [])
    prefill = torch.full_like(case.q, float("nan"))
    paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                            m.max_query_len, case.scale, prefill, window=window, softcap=5.0)
    assert_matches(prefill, ref, [])


# ----------------------------------------------------------------------------------------------
# Rope (and Qwen3's q/k norm, and FP8 products' column scales) fused into the KV-cache write


def _qkv_case(seed: int, rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              extra: str):
    """(q, k, v views of one q|k|v tensor [rows, width], the qkv tensor, a PendingRope at random positions) for the
    fused write; ``extra`` names what the rope carries besides rope: "norm", "mrope", "scales", joined by "+"."""
    from engine.models.norm import RMSNorm
    from engine.models.rotary import get_rope

    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=gen) * 2).to(dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    section = None
    if "mrope" in extra:
        quarter = head_dim // 8
        section = (head_dim // 2 - 2 * quarter, quarter, quarter)
    rope = get_rope(head_dim, 512, 1e4, mrope_section=section).to(DEVICE)
    norms = []
    if "norm" in extra:
        for _ in range(2):
            norm = RMSNorm(head_dim, 1e-6).to(device=DEVICE, dtype=dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.empty(head_dim).uniform_(0.5, 1.5, generator=gen))
            norms.append(norm)
    if section is None:
        positions = torch.randint(0, 512, (rows,), generator=gen)
    else:  # text positions in some tokens (all three rows equal), an image's grid in the others
        positions = torch.randint(0, 512, (3, rows), generator=gen)
        positions[:, ::3] = positions[0, ::3]
    column_scales = (torch.rand(width, generator=gen) + 0.5).to(DEVICE) if "scales" in extra else None
    pending = rope.pending(*norms).at(positions.to(DEVICE), column_scales)
    return (q.view(rows, num_heads, head_dim), k.view(rows, num_kv_heads, head_dim),
            v.view(rows, num_kv_heads, head_dim), qkv, pending)


def _unfused(qkv: torch.Tensor, pending, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v as the two-kernel path leaves them: the column-scale pass, then the rope kernel (with the norms)."""
    from engine.ops import fused as fused_ops
    from engine.ops.fp8 import scale_columns_

    rows = qkv.shape[0]
    if pending.column_scales is not None:
        qkv = scale_columns_(qkv.clone(), pending.column_scales)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(rows, num_heads, head_dim), k.view(rows, num_kv_heads, head_dim), v.view(rows, num_kv_heads,
                                                                                              head_dim)
    if pending.q_weight is not None:
        q, k = fused_ops.qk_norm_rotary(pending.positions, q, k, pending.q_weight, pending.k_weight, pending.eps,
                                        pending.cos_sin_cache, pending.mrope_section)
    else:
        q, k = fused_ops.rotary(pending.positions, q, k, pending.cos_sin_cache, pending.mrope_section)
    return q, k, v


def _assert_one_fp8_step(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """FP8 values equal, or (a float32 sum of the rotation in another order put a value on the other side of a
    rounding boundary) one float8 step apart, for a small fraction of them."""
    a, b = ours.float(), theirs.float()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2**-6))) - 3)
    near = (a - b).abs() <= step
    assert near.all() and (a != b).float().mean() < 0.01, (a[~near], b[~near])


def _assert_one_rounding(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal, or (queries rotated with their sums in another order) a float32 rounding of the sum apart, which a
    16-bit dtype rounds to the same value or the next one."""
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        return
    step = 2.0 ** (-7 if ours.dtype == torch.bfloat16 else -10)
    a, b = ours.float(), theirs.float()
    assert ((a - b).abs() <= b.abs() * step + 1e-6).all() and (a != b).float().mean() < 0.01


ROPE_EXTRAS = ["rope", "norm", "mrope", "norm+scales", "mrope+norm+scales"]


@pytest.mark.parametrize("extra", ROPE_EXTRAS)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["dense", "fp8", "fp8_fused"])
def test_write_paged_kv_with_rope_matches_rope_then_write(cache, dtype, head_dim, extra):
    """The write given the rope q and k still need (after Qwen3's norms, M-RoPE, the FP8 product's column scales
    first) leaves what the rope kernel followed by the plain write leaves: a 16-bit (or float32) cache in one
    launch, bit for bit, and the returned queries too; an FP8 cache as the engine calls it (the rope kernel apart)
    bit for bit as well. The FP8 write kernel roping q and K itself (``fuse_rope``): V's bytes and every scale as
    there, K (rotated for head dims 64 and 128, quantized as it is for 96) to a float8 step on a rare value, the
    rotated queries to a rounding of their sums. Negative slots write nothing, and q's rows past the slots (a
    decode graph's padding) are roped all the same."""
    fp8 = cache != "dense"
    num_heads, num_kv_heads, n, padding = 4, 2, 11, 2
    q, k, v, qkv, pending = _qkv_case(head_dim + len(extra), n + padding, num_heads, num_kv_heads, head_dim, dtype,
                                      extra)
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size = 5, 16
    slots = torch.randperm(num_blocks * block_size - block_size, generator=gen)[:n] + block_size
    slots[[2, 9]] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fp8:
        caches = [[torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)] for _ in range(2)]
        scales = [tuple(torch.ones(shape[:3], device=DEVICE) for _ in range(2)) for _ in range(2)]
    else:
        cache = [torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE) for _ in range(2)]
        caches = [[c.clone() for c in cache] for _ in range(2)]
        scales = [None, None]
    qkv_before = qkv.clone()
    ours = _launch_write(k, v, *caches[0], slots, scales[0], q=q, rope=pending,
                         fuse_rope=True if cache == "fp8_fused" else None)
    assert torch.equal(qkv, qkv_before), "q, k and v are read, never written"
    uq, uk, uv = _unfused(qkv, pending, num_heads, num_kv_heads, head_dim)
    theirs = write_paged_kv(uk, uv, *caches[1], slots, scales[1], q=uq)
    assert ours.shape == q.shape and ours.dtype == dtype and ours.is_contiguous()
    if cache != "fp8_fused":
        assert torch.equal(ours, theirs)
        for ours_cache, their_cache in zip(caches[0], caches[1]):
            assert torch.equal(ours_cache.view(torch.uint8), their_cache.view(torch.uint8))
        if fp8:
            assert torch.equal(scales[0][0], scales[1][0]) and torch.equal(scales[0][1], scales[1][1])
        return
    assert torch.equal(caches[0][1].view(torch.uint8), caches[1][1].view(torch.uint8))
    torch.testing.assert_close(scales[0][1], scales[1][1], atol=0, rtol=0)
    torch.testing.assert_close(scales[0][0], scales[1][0], atol=0, rtol=1e-6)
    _assert_one_fp8_step(caches[0][0], caches[1][0])
    if head_dim == 96:  # not rotated: rope, then quantized
        assert torch.equal(ours, theirs) and torch.equal(caches[0][0].view(torch.uint8),
                                                         caches[1][0].view(torch.uint8))
    else:
        _assert_one_rounding(ours, theirs)
    written = scales[0][0].view(-1, num_kv_heads)
    untouched = torch.ones(written.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert (written[untouched] == 1).all() and (written[~untouched] != 1).all()


@pytest.mark.parametrize("extra", ["rope", "mrope+norm+scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_slices, n, num_kv_heads", [(2, 13, 2), (3, 13, 2), (2, 1, 1)])
def test_write_paged_kv_adds_partial_products_of_qkv(num_slices, n, num_kv_heads, dtype, extra):
    """A q|k|v product cut along K (``rope.partials``, q, k and v views of the first slice): the write leaves the
    cache and returns the queries that the whole product, the slices' sum rounded once, gives; an FP8 cache or views
    of anything but the first slice are refused. One token with one KV head too (a batch-1 decode graph), whose views
    take strides of their own on their single row and head."""
    num_heads, head_dim = 4, 64
    _, _, _, qkv, pending = _qkv_case(7, n, num_heads, num_kv_heads, head_dim, dtype, extra)
    gen = torch.Generator().manual_seed(num_slices)
    partials = torch.stack([qkv] + [(torch.randn(qkv.shape, generator=gen) * 2).to(dtype=dtype, device=DEVICE)
                                    for _ in range(num_slices - 1)])
    whole = partials.float().sum(0).to(dtype)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    heads = (num_heads, num_kv_heads, num_kv_heads)

    def views(t):
        return [x.view(n, h, head_dim) for x, h in zip(t.split(widths, dim=-1), heads)]

    slots = (torch.randperm(48, generator=gen)[:n] + 16).to(DEVICE)
    shape = (4, 16, num_kv_heads, head_dim)
    caches = [[torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2)] for _ in range(2)]
    q, k, v = views(partials[0])
    ours = write_paged_kv(k, v, *caches[0], slots, q=q, rope=dataclasses.replace(pending, partials=partials))
    wq, wk, wv = views(whole)
    theirs = write_paged_kv(wk, wv, *caches[1], slots, q=wq, rope=pending)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours, theirs, **tol)
    for ours_cache, their_cache in zip(*caches):
        torch.testing.assert_close(ours_cache, their_cache, **tol)
    # The torch path (``PendingRope.apply``) adds them up the same way.
    got = dataclasses.replace(pending, partials=partials).apply(q, k, v)
    for a, b in zip(got, dataclasses.replace(pending).apply(wq, wk, wv)):
        assert torch.equal(a, b)
    bad = {  # what is wrong: (the change, the error it gets)
        "an FP8 cache": dict(k_cache=torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE),
                             v_cache=torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE),
                             kv_scales=tuple(torch.ones(shape[:3], device=DEVICE) for _ in range(2))),
        "views of the second slice": dict(zip("qkv", views(partials[1]))),
        "partials of another width": dict(partials=partials[:, :, :-64]),
        "partials of other rows": dict(partials=partials[:, 1:]),
        "partials of another dtype": dict(partials=partials.double()),
    }
    errors = {"an FP8 cache": "16-bit cache only", "views of the second slice": "q must be a view of columns 0..256",
              "partials of another width": "rows must be q|k|v", "partials of other rows": "q must be a view",
              "partials of another dtype": "partials must be"}
    for what, change in bad.items():
        args = dict(q=q, k=k, v=v, k_cache=caches[0][0], v_cache=caches[0][1], kv_scales=None, partials=partials)
        args.update(change)
        with pytest.raises(ValueError, match=errors[what]):
            write_paged_kv(args["k"], args["v"], args["k_cache"], args["v_cache"], slots, args["kv_scales"],
                           q=args["q"], rope=dataclasses.replace(pending, partials=args["partials"]))
            pytest.fail(f"accepted bad input: {what}")


@pytest.mark.parametrize("tokens_per_program, split_queries", [(1, True), (4, False), (16, True), (8, False)])
def test_write_paged_kv_fp8_with_rope_any_tokens_per_program(tokens_per_program, split_queries):
    """The FP8 write with rope gives the same bytes, scales and queries however many tokens a program takes and
    whether the queries have programs of their own (21 tokens and 3 padding rows: programs partly past the end)."""
    num_heads, num_kv_heads, head_dim, n = 8, 2, 64, 21
    q, k, v, qkv, pending = _qkv_case(5, n + 3, num_heads, num_kv_heads, head_dim, torch.float32, "norm+scales")
    slots = (torch.randperm(64, generator=torch.Generator().manual_seed(1))[:n] + 16).to(DEVICE)
    slots[4] = -1
    shape = (6, 16, num_kv_heads, head_dim)
    results = []
    for tokens, split in ((None, None), (tokens_per_program, split_queries)):
        cache = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
        scales = tuple(torch.ones(shape[:3], device=DEVICE) for _ in range(2))
        q_out = _launch_write(k, v, *cache, slots, scales, q=q, tokens_per_program=tokens, split_queries=split,
                              rope=pending, fuse_rope=True)
        results.append((q_out, cache[0].view(torch.uint8), cache[1].view(torch.uint8), *scales))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_write_paged_kv_with_rope_rejects_bad_inputs():
    q, k, v, _, pending = _qkv_case(3, 6, 4, 2, 64, torch.float32, "norm+scales")
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    slots = torch.arange(6, device=DEVICE)
    write_paged_kv(k, v, cache, cache.clone(), slots, q=q, rope=pending)
    bad = {
        "no q": dict(q=None),
        "positions length": dict(rope=dataclasses.replace(pending, positions=pending.positions[:5])),
        "column scales width": dict(rope=dataclasses.replace(pending, column_scales=pending.column_scales[:-1])),
        "column scales dtype": dict(rope=dataclasses.replace(pending, column_scales=pending.column_scales.double())),
        "k_norm without q_norm": dict(rope=dataclasses.replace(pending, q_norm=None)),
    }
    for what, change in bad.items():
        try:
            write_paged_kv(k, v, cache, cache.clone(), slots, **(dict(q=q, rope=pending) | change))
        except ValueError:
            continue
        pytest.fail(f"accepted bad input: {what}")


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_backends_agree_on_a_pending_rope(fp8_cache):
    """The Triton backend ropes in its KV-cache write; the torch backend ropes op by op first
    (``PendingRope.apply``): on a mixed batch with Qwen3's norms and column scales both give the same attention."""
    case = make_case(17, MIXED, 2, 2, 64, 16)
    n = case.q.shape[0]
    q, k, v, qkv, pending = _qkv_case(23, n, 4, 2, 64, torch.float32, "norm+scales")
    kv_scales = None
    k_cache, v_cache = case.k_cache, case.v_cache
    if fp8_cache:
        k_cache = torch.zeros(k_cache.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        kv_scales = tuple(torch.ones(k_cache.shape[:3], device=DEVICE) for _ in range(2))
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        caches = (k_cache.clone(), v_cache.clone(), tuple(s.clone() for s in kv_scales) if kv_scales else None)
        with torch.inference_mode():  # as the engine runs them (the norms' weights are parameters)
            outs.append(attend(backend, q, k, v, caches[0], caches[1], case.meta, case.scale, kv_scales=caches[2],
                               rope=pending))
    torch.testing.assert_close(outs[1], outs[0], **(TOL if not fp8_cache else dict(atol=2e-3, rtol=2e-3)))


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_compile_write_variants_covers_every_launch_choice(fp8_cache):
    """Start-up compiles the write as steps call it: one variant on a 16-bit cache, the three (tokens per program,
    queries apart) choices on an FP8 one; each twice where FP8 q|k|v products may leave their column scales."""
    from engine.ops.attention import compile_write_variants

    _, _, _, _, pending = _qkv_case(3, 1, 4, 2, 32, torch.float32, "mrope+norm")
    shape = (3, 16, 2, 32)
    if fp8_cache:
        caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
        kv_scales = tuple(torch.ones(shape[:3], device=DEVICE) for _ in range(2))
    else:
        caches, kv_scales = [torch.zeros(shape, device=DEVICE) for _ in range(2)], None
    before = [c.clone() for c in caches]
    rope = dataclasses.replace(pending, positions=None, column_scales=None)  # the layer's, as Attention holds it
    assert compile_write_variants(4, *caches, 600, kv_scales, torch.float32, rope) == (3 if fp8_cache else 1)
    assert compile_write_variants(4, *caches, 600, kv_scales, torch.float32, rope, column_scales=True) == (
        6 if fp8_cache else 2)
    assert compile_write_variants(4, *caches, 64, kv_scales, torch.float32) == 1
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, before))


@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["dense", "fp8"])
def test_tiny_qwen3_ropes_in_the_kv_write(kv_cache_dtype, tmp_path):
    """A whole model (Qwen3: q/k norms, then rope) hands its rope to attention: prefill, then a decode and a mixed
    step on the Triton backend (rope in the KV-cache write) give the torch backend's logits (rope op by op)."""
    from engine.loading.loader import load_model
    from engine.loading.model_config import ModelConfig
    from tests.helpers import VOCAB, PagedRunner, save_tiny_model

    model = load_model(ModelConfig.from_pretrained(save_tiny_model("qwen3", tmp_path)), torch.float32, DEVICE)
    assert all(layer.rope is not None and layer.rope.q_norm is not None for layer in model.attention_layers())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (19, 33)]
    steps = [[(0, prompts[0][:-1]), (1, prompts[1][:-1])],
             [(0, prompts[0][-1:]), (1, prompts[1][-1:]), (2, prompts[0][:5])]]
    outputs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        runner = PagedRunner(model)
        for attn in model.attention_layers():
            attn.set_backend(backend)
            if kv_cache_dtype is not None:
                cache = torch.zeros(attn.k_cache.shape, dtype=kv_cache_dtype, device=DEVICE)
                attn.bind_kv_cache(cache, cache.clone(),
                                   tuple(torch.ones(cache.shape[:3], device=DEVICE) for _ in range(2)))
        outputs.append([runner.step(chunks) for chunks in steps])
    for ref_step, got_step in zip(*outputs):
        for ref, got in zip(ref_step, got_step):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
