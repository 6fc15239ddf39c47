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
exactly the target's greedy tokens. Seeded rows are coupled to the target's own sampling instead: given each
position's noise (``engine.worker.sampler.seeded_noise``, drawn from the seed and the position alone), the target's
sample there is x_i = argmax(p_i / noise_i), the token the sampler draws without speculation; draft i is accepted
while it equals x_i, and the row ends with x_i where one differs (or x_k). For point-mass drafts this is the same
acceptance, min(1, p_i(x_i)), and the output is x_0 .. exactly: a seeded request's tokens are the ones it gets without
speculation. Everything runs on the device over the whole batch.
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
    seeded_noise: dict[int, torch.Tensor] | None = None,  # row -> its positions' Exp(1) noise [k + 1, vocab]
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
    uniforms = torch.rand((rows, k), device=device)
    accepted = torch.where(greedy[:, None], drafts == target_argmax[:, :k], uniforms * q_draft < p_draft)
    coupled = None
    if seeded_noise:  # the target's own samples at each position, which the drafts must equal
        if draft_probs is not None:
            raise ValueError("seeded rows are coupled to point-mass drafts only")
        seeded = torch.tensor(sorted(seeded_noise), device=device)
        noise = torch.stack([seeded_noise[row] for row in sorted(seeded_noise)])  # [seeded rows, k + 1, vocab]
        coupled = (target_probs[seeded] / noise).argmax(dim=-1)  # [seeded rows, k + 1]
        accepted[seeded] = drafts[seeded] == coupled[:, :k]
    accepted &= valid
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
    recovered = _draw(residual)
    if coupled is not None:
        recovered[seeded] = coupled.gather(1, stop[seeded, None])[:, 0]
    last = torch.where(greedy, target_argmax.gather(1, stop[:, None])[:, 0], recovered)
    out = torch.full((rows, k + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    keep = positions[None, :] < num_accepted[:, None]
    out[:, :k] = torch.where(keep, drafts, PLACEHOLDER)
    out.scatter_(1, stop[:, None], last[:, None])
    return out, num_accepted


def _draw(weights: torch.Tensor) -> torch.Tensor:
    """One id per row, with probability proportional to ``weights`` [rows, vocab] (non-negative, not normalised):
    the exponential race argmax(w / E), E ~ Exp(1), as the sampler draws."""
    return (weights / torch.empty_like(weights).exponential_()).argmax(dim=-1)
