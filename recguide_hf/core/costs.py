"""The measured price of a round on this hardware: lookup in a `recguide profile` cost table (or a simulation's
table, `bench.VirtualCosts.cost_table`). Maths only: it imports nothing from the package, so the policy that
reads prices and the profiler that measures them (profile.py, which runs the engine) need no import circle.
"""

from __future__ import annotations

import json
from pathlib import Path


def compiled_table(path: str | Path) -> Path:
    """Where the compiled forwards' table of a cost table lives (`recguide profile --compile`): beside it, with
    `_compiled` after its stem (`cost_table.json` -> `cost_table_compiled.json`)."""
    path = Path(path)
    return path.with_name(f"{path.stem}_compiled{path.suffix}")


class CostTable:
    """Lookup with linear interpolation in C (and nearest known B)."""

    def __init__(self, data: dict):
        self.data = data
        self.costs = {int(c): {int(b): v for b, v in per_b.items()} for c, per_b in data["costs"].items()}
        self.concurrencies = sorted(self.costs)
        self.block_sizes = sorted(set.intersection(*(set(per_b) for per_b in self.costs.values())))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls(json.loads(Path(path).read_text()))

    def _interp(self, c: float, b: int, key, index=None) -> float:
        cs = self.concurrencies
        c = min(max(c, cs[0]), cs[-1])
        lo = max(x for x in cs if x <= c)
        hi = min(x for x in cs if x >= c)

        def val(cc):  # a block size the table lacks (fixed-block mode only) reads its nearest neighbour
            bb = b if b in self.costs[cc] else min(self.costs[cc], key=lambda x: abs(x - b))
            v = self.costs[cc][bb].get(key, 0.0)  # a table from before `host` was measured: 0
            return v[index] if index is not None else v

        if lo == hi:
            return val(lo)
        w = (c - lo) / (hi - lo)
        return (1 - w) * val(lo) + w * val(hi)

    def draft(self, c: float, b: int) -> float:
        """Seconds of one draft forward with c rows of block b (0 for no rows)."""
        return 0.0 if c < 0.5 else self._interp(c, b, "draft")

    def verify(self, c: float, b: int, segments: float = 0.0) -> float:
        """Seconds of one verify forward with `segments` branch segments per row (fractional: interpolated)."""
        lo = int(segments)
        hi = min(lo + 1, 3)
        w = segments - lo
        return (1 - w) * self._interp(c, b, "verify", lo) + w * self._interp(c, b, "verify", hi)

    def host(self, c: float, b: int) -> float:
        """Seconds of the engine's own work in one round of c rows at block b, outside the forwards."""
        return 0.0 if c < 0.5 else self._interp(c, b, "host")

    def round_cost(self, c: float, b: int) -> float:
        """LinearSS round: one draft + one verify forward + the engine's work around them."""
        return self.draft(c, b) + self.verify(c, b) + self.host(c, b)

    def price(self, bucket_rounds: dict[tuple[int, int], int]) -> float:
        """Seconds the table gives a run's decode rounds: {(rows, block): how many bucket rounds} (the engine's
        `Stats.bucket_rounds`), each at `round_cost`. Prefills are not in it."""
        return sum(n * self.round_cost(rows, block) for (rows, block), n in bucket_rounds.items())

