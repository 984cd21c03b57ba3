"""Drafting maths: draft tokens from draft logits, and which positions the verifier will likely reject.

All functions take tensors and return tensors; the MASK token is excluded from every draft softmax, so
it can never be drafted or proposed as a correction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def mask_out(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Copy of logits [..., V] with the given tokens at -inf (MASK, and EOS where asked)."""
    logits = logits.clone()
    logits[..., token_ids] = float("-inf")
    return logits


@dataclass
class DraftBlock:
    """Drafted tokens d_1 .. d_K per row, with what mismatch prediction needs from their logits."""

    ids: torch.Tensor  # [R, K]
    margin: torch.Tensor | None  # [R, K] top-1 minus top-2 draft probability (MASK excluded); None: not needed
    correction: torch.Tensor | None  # [R, K] best token that is not MASK, EOS or the drafted token
    probs: torch.Tensor | None = None  # [R, K, V] draft distribution, only when sampling


def make_draft(draft_logits: torch.Tensor, mask_token_id: int, eos_token_ids: list[int],
               temperature: float | None = None, with_risk: bool = True) -> DraftBlock:
    """Pick drafts at each position: argmax (greedy) or a sample from softmax(logits / temperature).

    Args:
        draft_logits: [R, K, V] logits at the drafted positions (a MASK at j predicts the token at j).
        with_risk: also the margins and correction tokens branches need (a vocabulary-wide softmax and top-2
            per position: skipped when no branch can ride this round).
    """
    logits = mask_out(draft_logits.float(), [mask_token_id])
    if temperature is None:
        ids, sample_probs = logits.argmax(-1), None
    else:
        sample_probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
        ids = torch.multinomial(sample_probs.flatten(0, 1), 1).view(sample_probs.shape[:2])
    if not with_risk:
        return DraftBlock(ids, None, None, sample_probs)
    top2 = torch.softmax(logits, dim=-1).topk(2, dim=-1).values  # [R, K, 2]
    others = mask_out(logits, list(eos_token_ids))
    others.scatter_(2, ids[:, :, None], float("-inf"))
    return DraftBlock(ids, top2[..., 0] - top2[..., 1], others.argmax(-1), sample_probs)


@dataclass
class RiskyPositions:
    """Mismatch prediction for one draft block per row (docs/algorithm.md §2.2)."""

    positions: torch.Tensor  # [R, M] 1-based draft index p (d_p) of the earliest risky positions, -1 = none
    corrections: torch.Tensor  # [R, M] correction token c_p at each kept position, -1 = none
    num_risky: torch.Tensor  # [R] risky positions in the whole block (before keeping the earliest M)


def risky_positions(block: DraftBlock, draft_len: torch.Tensor, delta: float, max_corrections: int) -> RiskyPositions:
    """Positions whose draft margin is below `delta`; keep the earliest `max_corrections`.

    Args:
        draft_len: [R] real drafts per row (positions past it are ignored).
    """
    num_rows, k = block.ids.shape
    index = torch.arange(k, device=block.ids.device).expand(num_rows, k)
    risky = (block.margin < delta) & (index < draft_len[:, None])  # [R, K]
    order = torch.where(risky, index, index + k).argsort(dim=1, stable=True)[:, :max_corrections]  # [R, M]
    kept = risky.gather(1, order)
    none = torch.full_like(order, -1)
    positions = torch.where(kept, order + 1, none)
    corrections = torch.where(kept, block.correction.gather(1, order), none)
    return RiskyPositions(positions, corrections, risky.sum(1))
