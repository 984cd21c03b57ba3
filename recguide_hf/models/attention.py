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

Compiled forwards (`recguide_compile`) read the runs too, through one opaque custom op (`recguide::row_runs_sdpa`)
that reads them when it runs: the graph does not depend on them, so a new layout of rows is new data, not a new
graph, and a compiled forward no longer reads every row's keys up to the longest row's (or gathers a copy of a
subset's rows (CHANGELOG has the measurement). CUDA graphs cannot re-read runs at replay, so a compiled forward
on CUDA keeps one SDPA call (`CompiledForward.adapt`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ROW_RUNS = "recguide_row_runs"

# (first query row, first cache slot, rows, key width) of the forward being run; set by `RowCache.use`
_runs: list[tuple[int, int, int, int]] | None = None
_in_runs = False  # whether `_runs` is set: all a compiled graph reads of them (a guard on a bool, not on the list)

# what one more SDPA call costs, in key slots read for one row: a run is split where a shorter row would
# otherwise read more padding than this
RUN_OVERHEAD = 150


def set_runs(runs: list[tuple[int, int, int, int]] | None) -> None:
    global _runs, _in_runs
    _runs, _in_runs = runs, runs is not None


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


def _attend_runs(module, query, key, value, attention_mask, runs, **kwargs) -> torch.Tensor:
    """`sdpa_attention_forward` once per run: query rows [q, q + n) over cache slots [k, k + n), `width` keys."""
    outs = []
    for q, k, n, width in runs:
        mask = attention_mask[q:q + n, ..., :width] if attention_mask is not None else None
        out, _ = sdpa_attention_forward(module, query[q:q + n], key[k:k + n, :, :width], value[k:k + n, :, :width],
                                        mask, **kwargs)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


@torch.library.custom_op("recguide::row_runs_sdpa", mutates_args=())
def row_runs_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                  groups: int, is_causal: bool, dropout: float, scaling: float | None) -> torch.Tensor:
    """The runs' attention (`set_runs`, read when the op runs) as one op a compiled graph calls without tracing into
    it: the graph holds no runs, so a new layout of rows is new data, not a new graph. (Runs passed as a tensor
    argument were not enough: a tensor of one run and one of several compiled different graphs.) An op takes no
    module: `groups` and `is_causal` are the two attributes `sdpa_attention_forward` reads from it (groups 0: the
    layer has no `num_key_value_groups`)."""
    layer = SimpleNamespace(is_causal=is_causal, **({"num_key_value_groups": groups} if groups else {}))
    return _attend_runs(layer, query, key, value, attention_mask, _runs, dropout=dropout, scaling=scaling)


@row_runs_sdpa.register_fake
def _(query, key, value, attention_mask, groups, is_causal, dropout, scaling):
    rows, heads, q_len, _ = query.shape
    return query.new_empty(rows, q_len, heads, value.shape[-1])  # sdpa_attention_forward's [R, Q, H, D] layout


def row_runs_attention(module, query, key, value, attention_mask, **kwargs):
    """`sdpa_attention_forward` once per run of slots, each over the keys its rows need (module docstring)."""
    if torch.compiler.is_compiling():  # never read the runs themselves here: the graph would be guarded on them
        if not _in_runs:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        # what else `sdpa_attention_forward` reads from kwargs (position ids and the like it ignores): the op passes
        # none of it, so a layer that sets any of these attends the traced way
        if not any(kwargs.get(k) for k in ("softcap", "position_bias", "is_causal", "output_attentions")):
            out = torch.ops.recguide.row_runs_sdpa(
                query, key, value, attention_mask, int(getattr(module, "num_key_value_groups", 0)),
                bool(getattr(module, "is_causal", True)), float(kwargs.get("dropout", 0.0)), kwargs.get("scaling"))
            return out, None
    if _runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _attend_runs(module, query, key, value, attention_mask, _runs, **kwargs), None


AttentionInterface.register(ROW_RUNS, row_runs_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ROW_RUNS, sdpa_mask)
