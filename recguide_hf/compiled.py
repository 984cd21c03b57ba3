"""`recguide_compile`: the backbone's forward through `torch.compile` (issue 28), eager staying the reference.

One compiled callable wraps `Backbone.forward` with dynamic shapes, so rows, query widths and key widths are
symbolic: a handful of graphs (plain step, draft, verify, fused verify + branches) serve every round instead of
one per shape. On CUDA it uses `mode="reduce-overhead"` (CUDA graphs). What was measured so far (CPU, the bundled
model, linear-8 at C = 2, one thread beside another process): the whole forward traces into one graph per kind
with no graph break, greedy tokens equal eager's, the first serve spent minutes compiling 7 graphs, and later
serves reuse them. Whether it pays is `recguide bench`'s question; the default stays eager.

`warmup_s` counts the seconds of forwards that compiled a new graph (what a call paid to compile), so they can
be reported beside and left out of speed figures.
"""

from __future__ import annotations

import time

import torch


class CompiledForward:
    """Callable with `Backbone.forward`'s signature, compiled; tracks the time spent compiling."""

    def __init__(self, backbone):
        from torch._dynamo.utils import counters

        self._counters = counters
        mode = "reduce-overhead" if backbone.device.type == "cuda" else None
        self.fn = torch.compile(backbone.forward, dynamic=True, mode=mode)
        self.warmup_s = 0.0

    def __call__(self, *args, **kwargs):
        graphs = self._counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self._counters["stats"]["unique_graphs"] != graphs:  # this call compiled something
            self.warmup_s += time.perf_counter() - start
        return out
