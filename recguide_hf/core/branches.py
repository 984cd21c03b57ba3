"""Prospective branches: next-round drafts computed inside the verification forward (docs/algorithm.md §2.2).

Layout: all segments of a request share ONE row of the forward. The verifier segment `[seed, d_1..d_K]`
comes first (so the tokens to commit are the first slots), then up to three branch segments of B tokens:

* correction at p: `[c_p, MASK x (B-1)]` at offsets p .. p+B-1; it sees the verifier tokens at offsets
  0 .. p-1 (`seed, d_1 .. d_{p-1}`, the accepted prefix it hypothesises) and its own segment;
* continuation: `[MASK x B]` at offsets K+1 .. K+B; it sees the whole verifier segment and itself; its
  first position predicts the bonus token.

Reuse rules (exact): a correction at p is used iff the first mismatch is at p (p - 1 drafts accepted)
and the verifier's token equals c_p; the continuation iff all K drafts were accepted and the bonus equals
its first predicted token. A used branch supplies the next round's drafts, so that round needs no draft
forward, and its verify forward carries branches again (recursion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft import DraftBlock, RiskyPositions, make_draft

CORRECTION_1, CORRECTION_2, CONTINUATION = 0, 1, 2
KIND_NAMES = ("correction_1", "correction_2", "continuation")


@dataclass
class BranchPlan:
    """Segments per row, dense over S = most segments any row uses. Unused slots have kind -1."""

    kind: torch.Tensor  # [R, S] CORRECTION_1 / CORRECTION_2 / CONTINUATION / -1
    start: torch.Tensor  # [R, S] logical offset of the segment's first token from the committed length
    first_token: torch.Tensor  # [R, S] c_p, or MASK for the continuation
    prefix: torch.Tensor  # [R, S] verifier-segment tokens the segment may see
    block: int  # tokens per segment
    mask_token_id: int


def plan(risky: RiskyPositions, eff: torch.Tensor, block: int, continuation: bool, mask_token_id: int) -> BranchPlan:
    """Which branches each row carries this round.

    Args:
        eff: [R] verifier segment length (seed + drafts).
    """
    num_rows, m = risky.positions.shape
    kinds, starts, firsts, prefixes = [], [], [], []
    for j in range(m):
        p = risky.positions[:, j]
        has = p > 0
        kinds.append(torch.where(has, j, -1))
        starts.append(p.clamp(min=0))
        firsts.append(torch.where(has, risky.corrections[:, j], mask_token_id))
        prefixes.append(p.clamp(min=0))
    if continuation:
        has = (risky.num_risky <= 2) & (eff >= 1)
        kinds.append(torch.where(has, CONTINUATION, -1))
        starts.append(eff)
        firsts.append(torch.full_like(eff, mask_token_id))
        prefixes.append(eff)
    if not kinds:
        kinds = [torch.full((num_rows,), -1, dtype=torch.long, device=eff.device)]
        starts, firsts, prefixes = [eff * 0], [eff * 0 + mask_token_id], [eff * 0]
    kind, start = torch.stack(kinds, 1), torch.stack(starts, 1)
    first, prefix = torch.stack(firsts, 1), torch.stack(prefixes, 1)
    # pack used segments to the front and drop slots no row uses
    order = (kind < 0).long().argsort(dim=1, stable=True)
    kind, start, first, prefix = (t.gather(1, order) for t in (kind, start, first, prefix))
    used = int((kind >= 0).sum(1).max()) if kind.numel() else 0
    return BranchPlan(kind[:, :used], start[:, :used], first[:, :used], prefix[:, :used], block, mask_token_id)


def append_segments(plan: BranchPlan, ids, offsets, intra):
    """Extend a verifier-segment forward (ids/offsets [R, Q], intra [R, Q, Q]) with the branch segments: every
    column from Q on (the forward routes them to the drafting adapter with `draft_mask=Q`)."""
    num_rows, q = ids.shape
    s, b = plan.kind.shape[1], plan.block
    if s == 0:
        return ids, offsets, intra
    device = ids.device
    seg_ids = torch.full((num_rows, s, b), plan.mask_token_id, dtype=torch.long, device=device)
    seg_ids[:, :, 0] = plan.first_token
    seg_off = plan.start[:, :, None] + torch.arange(b, device=device)  # [R, S, B]
    used = plan.kind >= 0  # [R, S]
    total = q + s * b
    new_intra = torch.zeros(num_rows, total, total, dtype=torch.bool, device=device)
    new_intra[:, :q, :q] = intra
    col = torch.arange(q, device=device)
    sees_prefix = (col[None, None, :] < plan.prefix[:, :, None]) & used[:, :, None]  # [R, S, Q]
    sees_prefix &= intra.diagonal(dim1=1, dim2=2)[:, None, :]  # only real verifier tokens
    seg_of = torch.arange(s, device=device).repeat_interleave(b)  # [S*B]
    same_seg = seg_of[:, None] == seg_of[None, :]
    new_intra[:, q:, :q] = sees_prefix.repeat_interleave(b, dim=1)
    new_intra[:, q:, q:] = same_seg[None] & used.repeat_interleave(b, dim=1)[:, :, None]
    ids = torch.cat([ids, seg_ids.view(num_rows, s * b)], 1)
    offsets = torch.cat([offsets, seg_off.view(num_rows, s * b)], 1)
    return ids, offsets, new_intra


@dataclass
class Hits:
    """Which branch (if any) each row reuses, and the next block it supplies."""

    kind: torch.Tensor  # [R] kind of the reused branch, -1 = no hit
    block: DraftBlock | None  # drafts d'_1 .. d'_{B-1} for the rows with a hit (rows in `kind >= 0` order)

    def drop(self, rows_mask: torch.Tensor) -> Hits:
        """Forget the hits of the rows in `rows_mask` [R] (e.g. requests that just finished)."""
        if self.block is None or not bool((rows_mask & (self.kind >= 0)).any()):
            return self
        keep = ~rows_mask[self.kind >= 0]
        b = self.block
        block = DraftBlock(b.ids[keep], b.margin[keep], b.correction[keep], None if b.probs is None else b.probs[keep])
        kind = torch.where(rows_mask, torch.full_like(self.kind, -1), self.kind)
        return Hits(kind, block if bool(keep.any()) else None)


def reuse(plan: BranchPlan | None, verdict, draft_len: torch.Tensor, branch_logits: torch.Tensor | None,
          mask_token_id: int, eos_token_ids: list[int], temperature: float | None) -> Hits:
    """Apply the exact reuse rules.

    Args:
        verdict: num_accepted [R] and next_token [R] of this round.
        draft_len: [R] drafts verified this round.
        branch_logits: [R, S*B, V] logits of the branch segments.
    """
    n_acc, token = verdict.num_accepted, verdict.next_token
    none = torch.full_like(n_acc, -1)
    if plan is None or plan.kind.shape[1] == 0:
        return Hits(none, None)
    num_rows, s = plan.kind.shape
    b = plan.block
    seg_logits = branch_logits.view(num_rows, s, b, -1)
    bonus_guess = seg_logits[:, :, 0].float()
    bonus_guess[..., mask_token_id] = float("-inf")
    bonus_guess = bonus_guess.argmax(-1)  # [R, S]
    is_corr = (plan.kind == CORRECTION_1) | (plan.kind == CORRECTION_2)
    corr_hit = is_corr & (n_acc[:, None] == plan.start - 1) & (token[:, None] == plan.first_token)
    cont_hit = (plan.kind == CONTINUATION) & (n_acc == draft_len)[:, None] & (token[:, None] == bonus_guess)
    hit = corr_hit | cont_hit  # at most one per row
    any_hit = hit.any(1)
    seg = hit.float().argmax(1)
    kind = torch.where(any_hit, plan.kind.gather(1, seg[:, None]).squeeze(1), none)
    if not bool(any_hit.any()):
        return Hits(kind, None)
    rows = any_hit.nonzero().squeeze(1)
    logits = seg_logits[rows, seg[rows], 1:]  # [H, B-1, V]: masks at j predict d'_j
    return Hits(kind, make_draft(logits, mask_token_id, eos_token_ids, temperature))


class PendingBlocks:
    """Next-round drafts supplied by branch hits, per request row."""

    def __init__(self, num_rows: int, max_block: int, device):
        k = max_block - 1
        self.has = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.ids = torch.zeros(num_rows, k, dtype=torch.long, device=device)
        self.margin = torch.zeros(num_rows, k, device=device)
        self.correction = torch.zeros(num_rows, k, dtype=torch.long, device=device)
        self.probs: torch.Tensor | None = None

    def store(self, rows: torch.Tensor, hits: Hits):
        self.has[rows] = False
        if hits.block is None:
            return
        hit_rows = rows[hits.kind >= 0]
        k = hits.block.ids.shape[1]
        self.has[hit_rows] = True
        self.ids[hit_rows, :k] = hits.block.ids
        if hits.block.margin is not None:
            self.margin[hit_rows, :k] = hits.block.margin
            self.correction[hit_rows, :k] = hits.block.correction
        if hits.block.probs is not None:
            if self.probs is None:
                self.probs = torch.zeros(*self.ids.shape, hits.block.probs.shape[-1], device=self.ids.device)
            self.probs[hit_rows, :k] = hits.block.probs

    def take(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, DraftBlock]:
        """Rows with a stored block (bool [R]) and the stored drafts truncated to k; clears them."""
        have = self.has[rows].clone()
        self.has[rows] = False
        probs = self.probs[rows, :k] if self.probs is not None else None
        return have, DraftBlock(self.ids[rows, :k], self.margin[rows, :k], self.correction[rows, :k], probs)
