"""The engine's one timing seam: it brackets every phase of its work with `with self.phases(name):`.

Phases (engine.py): `admit` (a request's cache reset and prefill), `plan` (the policy's block sizes), per bucket
round `draft`, `branch_plan`, `verify`, `process` (the user's logits processors), `accept`, `commit`, `reuse`
(branches that came true), `record` (statistics), `observe` (the policy learning from the round), a plain step's
`plain`, and every backbone call's `forward`, which sits inside one of the others.

`Phases` does nothing (the default: a shared null context, nothing measurable per round). `PhaseClock` books the
engine clock's seconds per phase path ("verify/forward": the forwards inside verify), each phase's own seconds
without the phases nested in it, so the paths' seconds add up to the time spent inside the outermost phases.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable

_NOTHING = contextlib.nullcontext()


class Phases:
    """No timing (the engine's default)."""

    def __call__(self, name: str):
        return _NOTHING


class PhaseClock(Phases):
    """Seconds and calls per phase path on `clock`. On CPU every op is synchronous, so a wall clock measures the
    work; on CUDA pass `sync=torch.cuda.synchronize`, or the seconds are launch times."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None):
        self.clock, self.sync = clock, sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self._stack: list[list] = []  # [path, start, seconds of nested phases]

    @contextlib.contextmanager
    def __call__(self, name: str):
        path = f"{self._stack[-1][0]}/{name}" if self._stack else name
        if self.sync is not None:
            self.sync()
        frame = [path, self.clock(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self._stack.pop()
            spent = self.clock() - frame[1]
            self.seconds[path] += spent - frame[2]
            self.calls[path] += 1
            if self._stack:
                self._stack[-1][2] += spent

    def total(self, prefix: str = "") -> float:
        """Seconds of every path that starts with `prefix` (e.g. "admit": the prefill with its forwards)."""
        return sum(s for p, s in self.seconds.items() if p.startswith(prefix))

    def by_phase(self, outside: tuple[str, ...] = ()) -> dict[str, float]:
        """Seconds per phase name, nested paths folded into their last name ("verify/forward" -> "forward"),
        leaving out whatever sits inside the phases `outside` (e.g. ("admit",))."""
        out: dict[str, float] = defaultdict(float)
        for path, s in self.seconds.items():
            if path.split("/")[0] not in outside:
                out[path.rsplit("/", 1)[-1]] += s
        return dict(out)
