"""The batched multi-LoRA kernels (``engine.ops.lora``): the segmented (SGMV) and per-token (BGMV) shrink and expand
against the torch reference and against a per-token float64 loop, on random mappings with tokens under no adapter,
slots no token uses and ranks zero-padded to R; rows outside the mapping must stay as they were, bit for bit.

On a GPU they run compiled on CUDA tensors; without one, in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, which conftest sets on hosts without CUDA). Sizes are tiny for the interpreter; the test
marked ``gpu`` runs bfloat16 at a model's sizes and replays a CUDA graph with new mappings.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.ops import lora  # noqa: E402
from engine.ops.lora import (  # noqa: E402
    LoraTiles,
    expand_tiles,
    lora_expand,
    lora_expand_bgmv,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_bgmv,
    lora_shrink_reference,
    max_segment_tiles,
    segments,
    shrink_tiles,
)

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1 to test the kernels on the CPU", allow_module_level=True)

SENTINEL = 1234.5  # h's rows that no kernel may write


def _problem(t, k, n, r, s, dtype, seed, device=DEVICE):
    """x [t, k], a [s, r, k], b [s, n, r] with slot i of rank ``max(1, r - 3 i)`` (zero past it), y [t, n], and
    per-token slots in -1 .. s - 1, with the last slot (of several) never used."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(s, r, k, generator=gen) / k ** 0.5
    b = torch.randn(s, n, r, generator=gen) / r ** 0.5
    for slot in range(s):
        a[slot, max(1, r - 3 * slot):] = 0
        b[slot, :, max(1, r - 3 * slot):] = 0
    y = torch.randn(t, n, generator=gen)
    used = s - 1 if s > 1 else s
    slots = torch.randint(-1, used, (t,), generator=gen, dtype=torch.int32)
    return [v.to(device=device, dtype=dtype) for v in (x, a, b, y)] + [slots.to(device)]


def _float64_loop(x, a, b, y, slots):
    """Per token, in float64: h[t] = A_s x[t], y[t] + B_s h[t]; None for a token under no adapter."""
    hs, ys = [], []
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            hs.append(None)
            ys.append(None)
            continue
        h = a[slot].double() @ x[token].double()
        hs.append(h)
        ys.append(y[token].double() + b[slot].double() @ h)
    return hs, ys


def _mapping(slots, num_slots, pad=5):
    """The segmented form in buffers longer than the batch (as a CUDA graph's are), the tail holding junk."""
    order, starts = segments(slots.cpu().numpy(), num_slots)
    order = np.concatenate([order, np.full(pad, 10**6, np.int32)])
    return torch.from_numpy(order).to(slots.device), torch.from_numpy(starts).to(slots.device)


def _run(kind, x, a, b, y, slots, num_slots):
    """h (float32, unwritten rows holding SENTINEL) and y + h B^T, by the kernels of ``kind``."""
    h = torch.full((x.shape[0], a.shape[1]), SENTINEL, device=x.device)
    out = y.clone()
    if kind == "sgmv":
        order, starts = _mapping(slots, num_slots)
        lora_shrink(x, a, order, starts, h)
        lora_expand(torch.where(h == SENTINEL, 0.0, h), b, order, starts, out)
    elif kind == "bgmv":
        padded = torch.cat([slots, torch.full((3,), 7, dtype=torch.int32, device=slots.device)])
        lora_shrink_bgmv(x, a, padded, h)
        lora_expand_bgmv(torch.where(h == SENTINEL, 0.0, h), b, padded, out)
    else:
        lora_shrink_reference(x, a, slots, h)
        lora_expand_reference(torch.where(h == SENTINEL, 0.0, h), b, slots, out)
    return h, out


def _check_against_loop(h, out, x, a, b, y, slots, rtol):
    hs, ys = _float64_loop(x.cpu(), a.cpu(), b.cpu(), y.cpu(), slots.cpu())
    h, out = h.cpu(), out.cpu()
    for token, (want_h, want_y) in enumerate(zip(hs, ys)):
        if want_h is None:
            assert (h[token] == SENTINEL).all(), f"token {token} (no adapter): h written"
            assert torch.equal(out[token], y[token].cpu()), f"token {token} (no adapter): y touched"
            continue
        torch.testing.assert_close(h[token].double(), want_h, rtol=rtol, atol=rtol)
        torch.testing.assert_close(out[token].double(), want_y, rtol=rtol, atol=rtol)


CASES = [  # T, K, N, R, S
    (1, 64, 48, 16, 3),
    (7, 72, 200, 8, 4),
    (37, 200, 72, 48, 5),
    (70, 96, 136, 20, 2),
    (5, 40, 24, 1, 3),
]


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
@pytest.mark.parametrize("t,k,n,r,s", CASES)
def test_kernels_match_reference_and_float64_loop(kind, t, k, n, r, s):
    x, a, b, y, slots = _problem(t, k, n, r, s, torch.float32, seed=t * 31 + r)
    h, out = _run(kind, x, a, b, y, slots, s)
    ref_h, ref_out = _run("reference", x, a, b, y, slots, s)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    _check_against_loop(h, out, x, a, b, y, slots, rtol=1e-5)
    _check_against_loop(ref_h, ref_out, x, a, b, y, slots, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_small_tiles_split_k_and_several_tiles_per_slot(kind, monkeypatch):
    """Tiles of 16: about 27 tokens a slot (two token tiles each), three rank tiles and K cut into three slices of
    a few steps each, the last one short (K = 200); the expand with three N tiles and three steps over R."""
    monkeypatch.setattr(lora, "shrink_tiles", lambda *args, per_token: LoraTiles(1 if per_token else 16, 16, 16, 3))
    monkeypatch.setattr(lora, "expand_tiles", lambda *args, per_token: LoraTiles(1 if per_token else 16, 32, 16))
    x, a, b, y, slots = _problem(80, 200, 72, 40, 4, torch.float32, seed=5)
    h, out = _run(kind, x, a, b, y, slots, 4)
    _check_against_loop(h, out, x, a, b, y, slots, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_half_precision_rounds_once_into_y(kind):
    x, a, b, y, slots = _problem(19, 64, 80, 16, 3, torch.float16, seed=2)
    h, out = _run(kind, x, a, b, y, slots, 3)
    ref_h, ref_out = _run("reference", x, a, b, y, slots, 3)
    torch.testing.assert_close(h, ref_h, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-3, atol=2e-3)
    assert torch.equal(out[slots < 0], y[slots < 0])


def test_y_may_be_a_column_slice_and_columns_beside_it_stay():
    x, a, b, _, slots = _problem(9, 48, 40, 16, 3, torch.float32, seed=8)
    full = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    before = full.clone()
    order, starts = _mapping(slots, 3)
    h = torch.zeros(9, 16, device=DEVICE)
    lora_shrink(x, a, order, starts, h)
    lora_expand(h, b, order, starts, full[:, 10:50])
    want = before[:, 10:50].clone()
    lora_expand_reference(h, b, slots, want)
    torch.testing.assert_close(full[:, 10:50], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(full[:, :10], before[:, :10]) and torch.equal(full[:, 50:], before[:, 50:])


def test_no_token_under_an_adapter_and_empty_batch():
    x, a, b, y, _ = _problem(6, 32, 24, 16, 2, torch.float32, seed=3)
    none = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    for kind in ("sgmv", "bgmv"):
        h, out = _run(kind, x, a, b, y, none, 2)
        assert (h == SENTINEL).all() and torch.equal(out, y)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    lora_shrink(x[:0], a, empty, torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.zeros(0, 16, device=DEVICE))
    lora_expand_bgmv(torch.zeros(0, 16, device=DEVICE), b, empty, y[:0])


def test_shape_and_dtype_checks():
    x, a, b, y, slots = _problem(4, 32, 24, 16, 2, torch.float32, seed=4)
    with pytest.raises(ValueError, match="shapes"):
        lora_shrink_bgmv(x, a, slots, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="int32"):
        lora_shrink_bgmv(x, a, slots.long(), torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        lora_expand_bgmv(torch.zeros(4, 16, device=DEVICE, dtype=torch.float16), b, slots, y)


def test_segments_round_trip():
    rng = np.random.default_rng(0)
    for t, num_slots in [(0, 3), (1, 1), (50, 6), (200, 16)]:
        slots = rng.integers(-1, num_slots, t)
        slots[slots == num_slots // 2] = -1  # an empty slot in the middle
        order, starts = segments(slots, num_slots)
        assert order.dtype == np.int32 and starts.dtype == np.int32 and starts.shape == (num_slots + 1,)
        assert sorted(order.tolist()) == list(range(t)) and starts[0] == 0 and starts[-1] == (slots >= 0).sum()
        back = np.full(t, -1)
        for slot in range(num_slots):
            mine = order[starts[slot]:starts[slot + 1]]
            assert (np.diff(mine) > 0).all()  # stable: the slot's tokens in their order
            back[mine] = slot
        assert (back == slots).all()
        assert (slots[order[starts[-1]:]] == -1).all()  # the unmapped tokens last
    with pytest.raises(ValueError):
        segments(np.array([0, 3]), 3)


def test_tiles_follow_the_shapes():
    for r in (1, 8, 48, 1536):
        for per_token in (False, True):
            for tiles in (shrink_tiles(64, 4096, r, 8, 132, per_token), expand_tiles(64, 4096, r, 8, per_token)):
                assert min(tiles.block_n, tiles.block_k) >= 16 and (per_token or tiles.block_m >= 16)
    assert shrink_tiles(64, 4096, 16, 1, 132, False).split > 1  # one tile of tokens: K spread over the SMs
    assert shrink_tiles(8192, 4096, 16, 4, 132, False).split == 1
    assert shrink_tiles(64, 64, 16, 1, 132, False).split == 1  # too short a K to cut
    assert shrink_tiles(2048, 4096, 48, 2, 132, False).block_m == 64
    assert shrink_tiles(32, 4096, 48, 8, 132, False).block_m == 16
    # the grid bound holds for every split of T tokens over S slots, and is reached
    for t, s, block in [(1, 4, 16), (17, 4, 16), (100, 3, 32), (5, 9, 16)]:
        assert max_segment_tiles(t, s, block) >= -(-t // block)
        worst = sum(-(-n // block) for n in [t - min(s, t) + 1] + [1] * (min(s, t) - 1))
        assert max_segment_tiles(t, s, block) == worst


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (compiled kernels)")
def test_bfloat16_at_model_sizes_and_cuda_graph_replay():
    t, k, n, r, s = 300, 4096, 6144, 48, 8
    x, a, b, y, slots = _problem(t, k, n, r, s, torch.bfloat16, seed=0)
    for kind in ("sgmv", "bgmv"):
        h, out = _run(kind, x, a, b, y, slots, s)
        ref_h, ref_out = _run("reference", x, a, b, y, slots, s)
        mapped = slots >= 0
        err = (h[mapped] - ref_h[mapped]).norm() / ref_h[mapped].norm()
        assert err < 1e-3, f"{kind} shrink: relative error {err:.2e}"
        delta, ref_delta = out[mapped].float() - y[mapped].float(), ref_out[mapped].float() - y[mapped].float()
        err = (delta - ref_delta).norm() / ref_delta.norm()
        assert err < 2e-2, f"{kind} expand: relative error {err:.2e}"
        assert torch.equal(out[~mapped], y[~mapped])
    # one capture, replayed with new mappings written into the same buffers
    order, starts = _mapping(slots, s, pad=0)
    h = torch.zeros(t, r, device=DEVICE)
    out = y.clone()
    torch.cuda.synchronize()
    lora_shrink(x, a, order, starts, h)  # compile outside the capture
    lora_expand(h, b, order, starts, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_shrink(x, a, order, starts, h)
        lora_expand(h, b, order, starts, out)
    for seed in (1, 2):
        new = torch.randint(-1, s, (t,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        new_order, new_starts = segments(new.numpy(), s)
        order.copy_(torch.from_numpy(new_order))
        starts.copy_(torch.from_numpy(new_starts))
        h.zero_()
        out.copy_(y)
        graph.replay()
        want_h, want_out = _run("reference", x, a, b, y, new.to(DEVICE), s)
        mapped = new.to(DEVICE) >= 0
        torch.testing.assert_close(h[mapped], want_h[mapped], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=3e-2, atol=3e-2)
        assert torch.equal(out[~mapped], y[~mapped])
