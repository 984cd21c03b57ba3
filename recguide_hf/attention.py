"""Attention over the cache's rows in place: no copy of a subset's keys and values, no reads of padding.

A forward that covers only some request rows (one bucket of the block-size plan, or the rows still running
while others have finished) used to gather `keys[rows]` from the `RowCache` for every layer: a copy of those
rows' whole context per layer and forward, which at C = 64 doubled the forward's time (152 ms for 63 of 64
rows against 72 ms for all of them, B = 4, on the 2-core CPU). Instead the cache hands the attention its full
buffers (views, no copy) and the rows the forward covers as runs of consecutive slots; this attention runs
SDPA once per run, on slices of the buffers, and concatenates the outputs in the forward's row order.

A run also ends where the next row's key width (its committed length plus the query tokens) differs from the
run's by more padding than one more SDPA call costs (`RUN_OVERHEAD`), and each run attends only over its own
width: one call over every row reads every row's keys up to the longest row's, and at C = 64 plain steps are
bound by those reads (about 13 GB/s here). The serving loop places rows of similar lengths side by side.

It is registered with transformers' attention and mask interfaces as `ROW_RUNS` (the mask creation is SDPA's),
and the backbone selects it only for its own forwards over a `RowCache` of an SDPA model. A forward without
runs (every HF forward, and the engine's forwards over all rows of one run) is exactly `sdpa_attention_forward`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ROW_RUNS = "recguide_row_runs"

# (first query row, first cache slot, rows, key width) of the forward being run; set by `RowCache.use`
_runs: list[tuple[int, int, int, int]] | None = None

# what one more SDPA call costs, in key slots read for one row: a run is split where a shorter row would
# otherwise read more padding than this
RUN_OVERHEAD = 150


def set_runs(runs: list[tuple[int, int, int, int]] | None) -> None:
    global _runs
    _runs = runs


def row_runs(rows: list[int], widths: list[int]) -> list[tuple[int, int, int, int]] | None:
    """Runs of consecutive slots in `rows` (ascending, else None: the forward must gather), each with the key
    width its rows need (`widths`: per row, its committed length plus the forward's query tokens). A run also
    ends where the next row's width differs from the run's by more than `RUN_OVERHEAD`: attention then reads
    no row's keys past what its run needs, instead of every row's up to the longest."""
    runs: list[tuple[int, int, int, int]] = []
    for i, (r, w) in enumerate(zip(rows, widths)):
        if i and r <= rows[i - 1]:
            return None
        if runs and r == rows[i - 1] + 1:
            q, k, n, width = runs[-1]
            grow = n * (w - width) if w > width else width - w  # padding read if the row joins the run
            if grow <= RUN_OVERHEAD:
                runs[-1] = (q, k, n + 1, max(width, w))
                continue
        runs.append((i, r, 1, w))
    return runs


def row_runs_attention(module, query, key, value, attention_mask, **kwargs):
    """`sdpa_attention_forward` once per run of slots, each over the keys its rows need (module docstring)."""
    if _runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for q, k, n, width in _runs:
        mask = attention_mask[q:q + n, ..., :width] if attention_mask is not None else None
        out, _ = sdpa_attention_forward(module, query[q:q + n], key[k:k + n, :, :width], value[k:k + n, :, :width],
                                        mask, **kwargs)
        outs.append(out)
    return torch.cat(outs, 0), None


AttentionInterface.register(ROW_RUNS, row_runs_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ROW_RUNS, sdpa_mask)
