"""Block sizes per request and round, bucketing, and whether a forward carries branches: one scheduler.

Fixed mode: every request uses the configured B.

"auto" (DESIGN 2.3): each request picks `B* = argmax_B V_B(s_t, z_t) - rho_C * T_C(B)` where
* `V_B(s, z)` is the calibrated expected progress (tokens per round) given certainty `s_t` (minus the mean
  verifier entropy of the last two rounds) and state `z_t = (B_{t-1}, fully accepted?)` (calibrate.py);
* `T_C(B)` is the measured seconds of a LinearSS round (draft + verify) of block B with C requests in
  flight (profile.py);
* `rho_C` converts seconds into tokens: by default the best fixed-block rate at that load,
  `max_B mean(V_B) / T_C(B)`, so `V - rho T` is the progress a block buys beyond what its time would buy
  at the best fixed block. It can be set with `recguide_rho`.
The first round (no history) takes the best fixed block at that load, `argmax_B mean(V_B) / T_C(B)`.
Requests are bucketed by planned B: one draft and one verify forward per bucket.

Branches (DESIGN 2.2) ride in a verify forward only when the measured costs say they pay: the extra
query tokens cost `T_verify(C, B, S) - T_verify(C, B, 0)` for S segments per row, and they save an expected
`h * T_draft(C, B)` (h = branch hit rate, observed during the call; prior from calibration). At low load
the extra tokens are nearly free and branches stay; as load grows they are dropped, by the same rule,
with no hand-set concurrency thresholds. Without a cost table branches are always carried.
"""

from __future__ import annotations

import math
import warnings

import torch

from .calibrate import ValueTable
from .config import DecodingConfig
from .profile import CostTable


class BlockPolicy:
    def __init__(self, config: DecodingConfig, costs: CostTable | None = None, values: ValueTable | None = None):
        self.config = config
        self.costs, self.values = costs, values
        self.auto = config.block_size == "auto"
        self.candidates = list(config.block_sizes) if self.auto else [int(config.block_size)]
        if self.auto and (costs is None or values is None):
            warnings.warn("recguide_block_size='auto' without a cost table and a value table (run `recguide "
                          "profile` and `recguide calibrate`): using the largest candidate block", stacklevel=3)
        self.hits, self.branch_rounds = 1.0, 3.0  # prior hit rate 1/3 until calibration or observation says more
        if values is not None and "coverage" in values.data:
            self.hits, self.branch_rounds = 3 * values.data["coverage"], 3.0
        self.segments_seen, self.segment_rows = 2.0, 1.0  # prior: two branch segments per row

    @classmethod
    def from_config(cls, config: DecodingConfig, base_dir=None) -> BlockPolicy:
        from pathlib import Path

        def resolve(path):
            if path is None:
                return None
            p = Path(path)
            if not p.is_absolute() and base_dir is not None and (Path(base_dir) / p).exists():
                p = Path(base_dir) / p
            return p

        costs = CostTable.load(resolve(config.cost_table)) if config.cost_table else None
        values = ValueTable.load(resolve(config.value_table)) if config.value_table else None
        return cls(config, costs, values)

    # ------------------------------------------------------------------ block sizes
    def rho(self, c: int) -> float:
        if self.config.rho is not None:
            return self.config.rho
        return max(self.values.mean[b] / self.costs.round_cost(c, b) for b in self.candidates)

    def first_block(self, c: int) -> int:
        return max(self.candidates, key=lambda b: self.values.mean[b] / self.costs.round_cost(c, b))

    def choose(self, c: int, s: float | None, prev_block: int | None, full: bool | None) -> int:
        if s is None:
            return self.first_block(c)
        rho = self.rho(c)
        return max(self.candidates,
                   key=lambda b: self.values.value(b, s, prev_block, full) - rho * self.costs.round_cost(c, b))

    def plan(self, rows: torch.Tensor, stats, pending_has: torch.Tensor) -> torch.Tensor:
        """Planned block size [R] for the active rows."""
        if not self.auto:
            return torch.full_like(rows, self.candidates[0])
        if self.costs is None or self.values is None:
            return torch.full_like(rows, max(self.candidates))
        c = rows.numel()
        out = []
        for r in rows.tolist():
            prev = int(stats.last_block[r])
            if bool(pending_has[r]):  # a branch drafted this request's next block at its previous size
                out.append(prev)
                continue
            e1, e2 = (float(x) for x in stats.entropy[r])
            if math.isnan(e1):
                out.append(self.choose(c, None, None, None))
                continue
            s = -(e1 + (e2 if not math.isnan(e2) else e1)) / 2
            out.append(self.choose(c, s, prev, bool(stats.last_full[r])))
        return torch.tensor(out, device=rows.device)

    def buckets(self, rows: torch.Tensor, stats, pending_has: torch.Tensor):
        """Yield (block size, rows) groups: one draft and one verify forward per group."""
        planned = self.plan(rows, stats, pending_has)
        for block in planned.unique().tolist():
            yield int(block), rows[planned == block]

    # ------------------------------------------------------------------ branches
    def branches_on(self, num_rows: int, block: int) -> bool:
        """Whether this verify forward should carry branches: expected draft time saved > extra verify time."""
        if self.costs is None:
            return True
        h = self.hits / self.branch_rounds
        segments = self.segments_seen / self.segment_rows
        extra = self.costs.verify(num_rows, block, segments) - self.costs.verify(num_rows, block, 0)
        return h * self.costs.draft(num_rows, block) > extra

    def observe(self, num_rows: int, num_hits: int, num_segments: int):
        """Update the running hit rate and segments per row after a round that carried branches."""
        self.hits += num_hits
        self.branch_rounds += num_rows
        self.segments_seen += num_segments
        self.segment_rows += num_rows
