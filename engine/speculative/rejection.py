"""Verifying proposed tokens: which of a row's k draft tokens the target model accepts, and the token after them.

A verification step runs the target on each row's last token and its k proposals, so the target has k + 1
distributions per row: p_0 .. p_k (p_i is the target's distribution for the token after draft i - 1). Draft i was
drawn from the proposer's q_i (a draft model's distribution, or a point mass for n-gram proposals). Standard
speculative sampling (Leviathan et al. 2023; Chen et al. 2023) then keeps the output distributed exactly as the
target's own sampling:

* draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the first rejection;
* at a rejection, the row's next token is drawn from the residual max(0, p_i - q_i), normalised (for a point mass
  q_i that is p_i without x_i);
* when all of a row's drafts are accepted, a bonus token is drawn from p_k.

Greedy rows accept a draft while it is the target's argmax, and end with the argmax where they stop: their output is
exactly the target's greedy tokens. Everything runs on the device over the whole batch; a row with its own seed takes
its uniforms (one per draft of its own) and its residual draw from its generator, so its tokens do not depend on the
batch.
"""

from __future__ import annotations

import torch

PLACEHOLDER = -1  # output positions past a row's last token


def rejection_sample(
    draft_tokens: torch.Tensor,  # [rows, k] int64; past a row's num_drafts: anything
    num_drafts: torch.Tensor,  # [rows] int64, 0..k
    target_probs: torch.Tensor,  # [rows, k + 1, vocab] float32: the target's sampling distributions p_0 .. p_k
    target_argmax: torch.Tensor,  # [rows, k + 1] int64: the argmax of the target's logits, for greedy rows
    greedy: torch.Tensor,  # [rows] bool
    draft_probs: torch.Tensor | None = None,  # [rows, k, vocab] float32 q_i; None: point masses at the drafts
    generators: dict[int, torch.Generator] | None = None,  # row -> its seeded generator
    seeded_drafts: dict[int, int] | None = None,  # row -> its num_drafts, for each seeded row (default: k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the output tokens [rows, k + 1] (the accepted drafts, then the recovered or bonus token, then
    ``PLACEHOLDER``) and the number of accepted drafts per row [rows]; a row's output has that many + 1 tokens."""
    rows, k = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_drafts[:, None]  # [rows, k]
    drafts = torch.where(valid, draft_tokens, 0)
    # Accept draft i with probability min(1, p/q): u < p / q, as u * q < p (u in [0, 1)).
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [rows, k]
    q_draft = (draft_probs.gather(-1, drafts[..., None])[..., 0] if draft_probs is not None
               else torch.ones_like(p_draft))
    uniforms = _uniforms((rows, k), device, generators, seeded_drafts)
    accepted = torch.where(greedy[:, None], drafts == target_argmax[:, :k], uniforms * q_draft < p_draft) & valid
    # The drafts before the first rejection (or all of the row's).
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)  # [rows]
    stop = num_accepted  # the position of the recovered or bonus token
    rejected = stop < num_drafts  # the row stopped at a rejected draft (else all accepted: a bonus)
    # What the stopping position draws from: max(0, p - q) after a rejection (for a point mass, p without the
    # rejected draft), p itself for a bonus.
    every_row = torch.arange(rows, device=device)
    residual = target_probs[every_row, stop]  # [rows, vocab]
    if k:
        at = stop.clamp(max=k - 1)
        q = (draft_probs[every_row, at] if draft_probs is not None
             else torch.zeros_like(residual).scatter_(1, drafts[every_row, at][:, None], 1.0))
        residual = torch.where(rejected[:, None], (residual - q).clamp(min=0), residual)
    recovered = _draw(residual, generators)
    last = torch.where(greedy, target_argmax.gather(1, stop[:, None])[:, 0], recovered)
    out = torch.full((rows, k + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    keep = positions[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, drafts, PLACEHOLDER)
    out.scatter_(1, stop[:, None], last[:, None])
    return out, num_accepted


def _uniforms(shape: tuple[int, int], device: torch.device, generators: dict[int, torch.Generator] | None,
              seeded_drafts: dict[int, int] | None) -> torch.Tensor:
    """[rows, k] uniforms; a seeded row's first num_drafts from its generator (the rest are never read), so that
    what it draws does not depend on the other rows' drafts."""
    uniforms = torch.rand(shape, device=device)
    for row, generator in (generators or {}).items():
        n = shape[1] if seeded_drafts is None else seeded_drafts[row]
        uniforms[row, :n] = torch.rand(n, device=device, generator=generator)
    return uniforms


def _draw(weights: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """One id per row, with probability proportional to ``weights`` [rows, vocab] (non-negative, not normalised):
    the exponential race argmax(w / E), E ~ Exp(1), as the sampler draws."""
    noise = torch.empty_like(weights).exponential_()
    for row, generator in (generators or {}).items():
        noise[row].exponential_(generator=generator)
    return (weights / noise).argmax(dim=-1)
