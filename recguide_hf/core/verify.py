"""Verification: which drafted tokens the verifier accepts, and the token it adds.

Terms (docs/algorithm.md §7): a round verifies the block `[seed, d_1 .. d_K]`; the verifier's distribution at block
index i is for the token after `d_i` (index 0: after the seed). Drafts are accepted as a prefix:
`d_i` survives only if `d_1 .. d_{i-1}` did. With n accepted, the round emits n + 1 tokens: the accepted
drafts and one verifier token, the *recovered* token (n < K) or the *bonus* token (n = K).

Greedy: accept `d_i` while it equals the verifier's argmax. Sampling (speculative sampling): accept `d_i`
with probability `min(1, target_probs(d_i) / draft_probs(d_i))`; at the first rejection sample the
recovered token from `norm(max(0, target_probs - draft_probs))`; after full acceptance sample the bonus
from `target_probs`. This leaves the output distribution exactly the verifier's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    """Outcome of verifying one block per row."""

    num_accepted: torch.Tensor  # [R] drafts accepted, 0 .. draft_len
    next_token: torch.Tensor  # [R] recovered or bonus token (the next seed)


def _prefix_len(accept: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    # accept: [R, K] bool -> length of the all-True prefix, capped at draft_len
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < draft_len[:, None]
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def greedy_verify(draft_ids: torch.Tensor, target_ids: torch.Tensor, draft_len: torch.Tensor) -> Verdict:
    """Greedy acceptance.

    Args:
        draft_ids: [R, K] d_1 .. d_K (entries past draft_len are ignored).
        target_ids: [R, K+1] verifier argmax at block indices 0 .. K.
        draft_len: [R] number of real drafts per row.
    """
    num_accepted = _prefix_len(draft_ids == target_ids[:, :-1], draft_len)
    next_token = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return Verdict(num_accepted, next_token)


def sampling_verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    draft_len: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """Speculative sampling.

    Args:
        draft_ids: [R, K] sampled drafts.
        draft_probs: [R, K, V] distribution each draft was sampled from.
        target_probs: [R, K+1, V] verifier distribution (after the user's processors/warpers).
        draft_len: [R] real drafts per row.
    """
    num_rows, k = draft_ids.shape
    p_tok = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2)  # [R, K]
    q_tok = draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2)
    u = torch.rand(num_rows, k, device=draft_ids.device, generator=generator)
    accept = u * q_tok <= p_tok  # u < p/q without dividing by zero
    num_accepted = _prefix_len(accept, draft_len)
    rows = torch.arange(num_rows, device=draft_ids.device)
    p_next = target_probs[rows, num_accepted]  # [R, V]
    rejected = num_accepted < draft_len
    q_next = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k > 0 else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp(min=0)
    # a rejection implies p(d) < q(d), so the residual has mass; guard against rounding to zero anyway
    use_residual = rejected & (residual.sum(-1) > 0)
    dist = torch.where(use_residual[:, None], residual, p_next)
    next_token = torch.multinomial(dist / dist.sum(-1, keepdim=True), 1, generator=generator).squeeze(1)
    return Verdict(num_accepted, next_token)
