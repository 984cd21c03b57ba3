"""`recguide_compile`: the backbone's forward through `torch.compile` (issue 28), eager staying the reference.

The forwards of a round come in four kinds, and each kind is compiled as its own function (its own code object,
so its own dynamo cache and recompile budget): a plain step (one query per row), a draft forward (every token
drafts), a verify forward (base weights only) and a mixed forward (verifier tokens, then draft tokens: branches,
or `recguide_first_draft="verifier"`). Shapes are dynamic (rows, query widths and key widths are symbolic), so a
handful of graphs per kind serve every round. On CUDA it uses `mode="reduce-overhead"` (CUDA graphs).

Why per kind: one compiled `Backbone.forward` met its graph variants (draft mask kind, cache write path, one row
or many) one after another, and at C = 2 the ninth variant hit dynamo's `recompile_limit` (8): from there the
frame ran eagerly, so compiled RecGuide measured the same speed as eager at C >= 2. Two more things keep the
variants few: a compiled forward always writes the cache with one scatter and reads it through the row-runs op
whenever the cache reads runs (`RowCache.uniform`; attention.py), and prefills (one per request, a new width each
time) run eagerly, as HF's compiled `generate` prefills eagerly too.

`warmup_s` counts the seconds of forwards that compiled a new graph (what a call paid to compile), so they can
be reported beside and left out of speed figures, and the adaptive policy does not read a compiling round as a
price. A later call can still meet a variant the first did not (a bucket of one row, a subset of the rows), so
a serve's compile seconds can be non-zero after a warm-up pass too: `recguide bench` then counts that pass as
warm-up and runs it again.
"""

from __future__ import annotations

import time

import torch


def _step(backbone, *args, **kwargs):
    return backbone.forward(*args, **kwargs)


def _draft(backbone, *args, **kwargs):
    return backbone.forward(*args, **kwargs)


def _verify(backbone, *args, **kwargs):
    return backbone.forward(*args, **kwargs)


def _mixed(backbone, *args, **kwargs):
    return backbone.forward(*args, **kwargs)


def forward_kind(input_ids: torch.Tensor, draft_mask) -> str:
    """Which compiled function serves a forward: its draft mask kind, else its query width."""
    if draft_mask is None:
        return "step" if input_ids.shape[1] == 1 else "verify"
    if isinstance(draft_mask, int) and draft_mask == 0:  # every token drafts
        return "draft"
    return "mixed"


class CompiledForward:
    """Callable with `Backbone.forward`'s signature: prefills eager, every other forward compiled by kind; tracks
    the time spent compiling."""

    def __init__(self, backbone):
        from torch._dynamo.utils import counters

        self._counters = counters
        self.backbone = backbone
        mode = "reduce-overhead" if backbone.device.type == "cuda" else None
        functions = {"step": _step, "draft": _draft, "verify": _verify, "mixed": _mixed}
        self.fns = {kind: torch.compile(fn, dynamic=True, mode=mode) for kind, fn in functions.items()}
        self.cuda_graphs = mode == "reduce-overhead"
        self.warmup_s = 0.0

    def adapt(self, cache):
        """Set a cache up for compiled forwards: one scatter write and, where the cache reads runs, always the runs
        op (few graphs per kind); under CUDA graphs one SDPA call over every row (a replay cannot re-read runs)."""
        cache.uniform = True
        if self.cuda_graphs:
            cache.row_runs = False
        return cache

    def __call__(self, input_ids, position_ids, attention_mask, cache, draft_mask=None, logits_to_keep=0):
        # a prefill: eager (each prompt length would be a new shape to guard); so is any forward before every layer
        # of the cache has its buffers (they are made at a layer's first write: never inside a graph)
        if cache._binding.fresh or not cache.made:
            return self.backbone.forward(input_ids, position_ids, attention_mask, cache, draft_mask, logits_to_keep)
        fn = self.fns[forward_kind(input_ids, draft_mask)]
        # contiguous inputs: a slice of a wider buffer has other strides, and dynamo guards on strides (a
        # non-contiguous `input_ids` compiled a second verify graph in the middle of a timed bench pass)
        input_ids, position_ids = input_ids.contiguous(), position_ids.contiguous()
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = attention_mask.contiguous()
        if isinstance(draft_mask, torch.Tensor):
            draft_mask = draft_mask.contiguous()
        graphs = self._counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        if self.cuda_graphs:  # a new step: earlier replays' outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(self.backbone, input_ids, position_ids, attention_mask, cache, draft_mask=draft_mask,
                 logits_to_keep=logits_to_keep)
        if self._counters["stats"]["unique_graphs"] != graphs:  # this call compiled something
            self.warmup_s += time.perf_counter() - start
        # a CUDA graph's output lives in its memory pool and the next replay overwrites it, but the engine keeps
        # a forward's logits across the next forward (drafts for the next round come out of this verify): own it
        return out.clone() if self.cuda_graphs else out
