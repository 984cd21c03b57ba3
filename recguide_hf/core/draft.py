"""Drafting maths: draft tokens from draft logits, and which positions the verifier will likely reject.

All functions take tensors and return tensors; the MASK token is excluded from every draft softmax, so
it can never be drafted or proposed as a correction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import block_intra


def mask_out(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Copy of logits [..., V] with the given tokens at -inf (MASK, and EOS where asked)."""
    logits = logits.clone()
    logits[..., token_ids] = float("-inf")
    return logits


def draft_layout(seeds: torch.Tensor, width: torch.Tensor, q: int, mask_id: int, first_draft: str):
    """One draft forward's inputs: `[seed, MASK x (q - 1)]` per row, each row's first `width[i]` tokens real.

    Returns (ids [S, q], intra [S, q, q] bool, offsets [S, q], draft_mask): the block is bidirectional, padding past a
    row's width invisible to its other tokens; with `first_draft="verifier"` the seed sees the prefix and itself only
    and runs with the base weights (its logits are the verifier's next-token prediction, d_1), the drafting adapter
    on the masks (draft_mask 1: columns 1..); with "mask" every token is a draft token (draft_mask 0)."""
    num_rows, device = seeds.shape[0], seeds.device
    ids = torch.full((num_rows, q), mask_id, dtype=torch.long, device=device)
    ids[:, 0] = seeds
    valid = torch.arange(q, device=device)[None, :] < width[:, None]  # [S, q]
    intra = block_intra(num_rows, q, device) & valid[:, None, :]
    offsets = torch.arange(q, device=device).expand(num_rows, -1)
    if first_draft == "verifier":
        intra[:, 0, 1:] = False  # `intra` is this function's own tensor (the `&` above made it)
        return ids, intra, offsets, 1
    return ids, intra, offsets, 0


def draft_logits_of(logits: torch.Tensor, first_draft: str) -> torch.Tensor:
    """The logits of d_1 .. d_{q-1} from a draft forward's `[S, q, V]` output (`draft_layout`): the seed's own and
    the masks' after the first ("verifier"), or the masks' ("mask": a MASK at j predicts the token at j)."""
    if first_draft == "verifier":
        return torch.cat([logits[:, :1], logits[:, 2:]], dim=1)
    return logits[:, 1:]


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
