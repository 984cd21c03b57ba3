"""4D attention masks and position ids for forwards over a `RowCache`.

Every forward has the same shape: each row r has a committed prefix in cache slots `[pad_r, len_r)`
(`pad_r` = left padding of its prompt) and Q new query tokens written to slots `len_r .. len_r + Q - 1`.
What a query sees among the new tokens is a per-row boolean `[Q, Q]` pattern ("intra" mask): causal for
verification, all-to-all for a draft block, a tree for fused verify + branch segments. Every query always
sees the whole committed prefix and itself.

Rows of different lengths share one padded forward in groups (`length_groups`).
"""

from __future__ import annotations

import torch


def left_pad(prompts, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of prompts (token-id lists or 1-D tensors) as `(input_ids, attention_mask)` [N, longest], padded on
    the left: decoding appends on the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Turn a boolean "may attend" mask into the additive float mask HF attention expects.

    Disallowed entries get the dtype's most negative finite value rather than -inf, so a row that sees
    nothing (a padding query) gives a uniform average instead of NaN.
    """
    # [R, 1, Q, K] -> same shape, 0.0 where allowed
    zeros = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zeros, torch.finfo(dtype).min)


def length_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Indices into `lengths` grouped for padded forwards: sorted longest first, a group grows while its
    padded size (rows x its longest) stays within `1 + waste` times its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + waste) * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def causal_intra(num_rows: int, query_len: int, device=None) -> torch.Tensor:
    """`[R, Q, Q]` lower-triangular pattern (verification)."""
    return torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril().expand(num_rows, -1, -1)


def block_intra(num_rows: int, query_len: int, device=None) -> torch.Tensor:
    """`[R, Q, Q]` all-to-all pattern (one bidirectional draft block)."""
    return torch.ones(num_rows, query_len, query_len, dtype=torch.bool, device=device)


def build_mask(lengths: torch.Tensor, pads: torch.Tensor, intra: torch.Tensor, kv_len: int,
               dtype: torch.dtype = torch.float32, write_offset: int = 0) -> torch.Tensor:
    """Additive mask `[R, 1, Q, kv_len]`.

    Args:
        lengths: [R] committed slots per row (new tokens start there).
        pads: [R] left-padding slots of each row's prompt (never visible).
        intra: [R, Q, Q] bool, query i may see new token j.
        write_offset: the new tokens sit this many slots past the committed length (slots in between,
            another forward's scratch, are invisible).
    """
    num_rows, query_len, _ = intra.shape
    col = torch.arange(kv_len, device=intra.device)
    prefix = (col[None, :] >= pads[:, None]) & (col[None, :] < lengths[:, None])  # [R, KV]
    rel = col[None, :] - (lengths[:, None] + write_offset)  # [R, KV] index among the new tokens
    is_new = (rel >= 0) & (rel < query_len)
    gathered = torch.gather(intra, 2, rel.clamp(0, query_len - 1)[:, None, :].expand(-1, query_len, -1))
    allowed = (prefix[:, None, :] | (gathered & is_new[:, None, :]))  # [R, Q, KV]
    diag = rel[:, None, :] == torch.arange(query_len, device=intra.device)[None, :, None]
    return additive_mask((allowed | diag)[:, None], dtype=dtype)


def positions(lengths: torch.Tensor, pads: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Position ids `[R, Q]` of new tokens at `offsets` ([R, Q] or [Q]) slots past the committed length."""
    return (lengths - pads)[:, None] + offsets
