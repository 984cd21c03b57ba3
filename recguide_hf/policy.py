"""Block sizes per request and round, bucketing, and whether a forward carries branches: one scheduler.

Fixed mode: every request uses the configured B (B = 1: plain decoding steps in the engine).

"auto" (docs/algorithm.md §2.3), one rule: each round, the plan (a block size for every active request) that maximises
`sum_r V_B_r(s_r, z_r) - C * rho_C * sum_buckets T_n(B)`, expected tokens minus what the round's time would
have bought at the best fixed block, where
* the candidates are the block sizes the cost table measured on this hardware (`recguide profile`), by
  default {1, 2, 4, 8, 16, 32, 64}; `recguide_block_sizes` narrows them (the paper's set: [8, 16, 32]);
* `V_B(s, z)` is the calibrated expected progress (tokens per round) given the signal `s_t` and state
  `z_t = (B_{t-1}, fully accepted?)`, shrunk toward the block's mean as far as it failed to predict out of
  fold (calibrate.py); without history it is the mean. The value table says what `s_t` is: minus the mean
  verifier entropy of the last two rounds (docs/algorithm.md §2.3's certainty), or the mean drafts they accepted, each
  capped at B_{t-1} - 1 (recent verification outcomes; 0 after a plain step), which needs no entropy pass;
  `V_1 = 1` exactly: a plain step always yields one token;
* `T_n(B)` is the measured seconds of a LinearSS round of block B for n rows: its draft and verify
  forwards plus the engine's own work around them (profile.py); `T_n(1)` is one plain decoding step (no
  draft forward). Requests are bucketed by B, one
  draft and one verify forward per bucket, so the round costs the SUM over its buckets: splitting a batch
  is priced, and on hardware where a forward has a large fixed cost a split must earn it;
* `rho_C = max_B mean(V_B) / T_C(B)` per request (set it with `recguide_rho`);
* online (`recguide_online_costs`, on by default): the table was measured on static batches at one prefix
  length, while a served call has other lengths, admissions and a busy host. The engine times every
  bucket's round; `g` is the running mean of log(measured / table) over all rounds and `d_B` that of B's
  rounds above `g`, and after n_B rounds of B, with w = n_B / (n_B + prior), `T_n(B)` reads the table's
  price times exp(g + w d_B - (1 - w) u). Only the per-B part can change a plan (a factor common to every
  B cancels against rho). `u` (`recguide_online_optimism`, 0.03) is optimism for what has not been
  measured: a size within ~3% of the best gets tried and is then read as measured, while a size the table
  prices far worse is never tried. `prior` (`recguide_online_prior`, 8 rounds) is the table's weight. The
  defaults come from a sweep on the bundled model (README): the measured relative prices stayed within a
  few percent of the table's, and larger optimism (0.1, prior 16) made near-tied sizes alternate and cost
  up to 10% at C = 16. `generate` keeps these prices on the model from call to call (short calls then
  learn from the earlier ones); each `recguide bench` run starts afresh.
The plans weighed are: every request at the same B, for each candidate B, and every request at its own
`argmax_B V_B - rho_C T_C(B)`. With no history this is the best fixed block for the load. B = 1 is the
fallback that keeps decoding from being slower than plain steps: whenever drafts are not worth their
forward at this load the round is a plain step, and the round after may speculate again. No threshold on
concurrency appears anywhere: load enters only through the measured `T`.

Branches (docs/algorithm.md §2.2) ride in a verify forward only when the measured costs say they pay: the extra
query tokens cost `T_verify(C, B, S) - T_verify(C, B, 0)` for S segments per row, and they save an expected
`h * T_draft(C, B)` (h = branch hit rate, observed during the call; prior from calibration). At low load
the extra tokens are nearly free and branches stay; as load grows they are dropped, by the same rule.
Without a cost table branches are always carried.
"""

from __future__ import annotations

import math
import warnings

import torch

from .calibrate import ValueTable, accepted_signal
from .config import PAPER_BLOCK_SIZES, DecodingConfig
from .costs import CostTable, compiled_table

ONLINE_RATE = 0.05  # weight of the newest round in the running means of log(measured / table seconds)


class OnlinePrices:
    """The running correction of the cost table by measured round times (module docstring, "online"). One
    lives as long as its owner wants: `generate` keeps one per model and cost table across calls."""

    def __init__(self):
        self.common, self.rounds = 0.0, 0  # g: running mean of log(measured / table seconds), every round
        self.above: dict[int, float] = {}  # d_B: running mean of B's log ratio above g
        self.seen: dict[int, int] = {}  # n_B: rounds of B measured

    def factor(self, block: int, optimism: float, prior: float) -> float:
        """exp(g + w d_B - (1 - w) u), w = n_B / (n_B + prior), u = optimism (module docstring)."""
        w = self.seen.get(block, 0) / (self.seen.get(block, 0) + prior)
        return math.exp(self.common + w * self.above.get(block, 0.0) - (1 - w) * optimism)

    def observe(self, block: int, log_ratio: float):
        self.rounds += 1
        self.common += max(ONLINE_RATE, 1.0 / self.rounds) * (log_ratio - self.common)
        above = log_ratio - self.common
        n = self.seen[block] = self.seen.get(block, 0) + 1
        old = self.above.get(block, 0.0)
        self.above[block] = old + max(ONLINE_RATE, 1.0 / n) * (above - old)


class BlockPolicy:
    def __init__(self, config: DecodingConfig, costs: CostTable | None = None, values: ValueTable | None = None,
                 prices: OnlinePrices | None = None):
        self.config = config
        self.costs, self.values = costs, values
        self.auto = config.block_size == "auto"
        if not self.auto:
            self.candidates = [int(config.block_size)]
        elif config.block_sizes is not None:
            self.candidates = sorted(config.block_sizes)
        else:
            self.candidates = costs.block_sizes if costs is not None else list(PAPER_BLOCK_SIZES)
        self.max_block = max(self.candidates)
        self._sizes = torch.tensor(self.candidates)
        self._at_load: dict[int, tuple[float, torch.Tensor]] = {}
        if self.auto and (costs is None or values is None):
            warnings.warn("recguide_block_size='auto' without a cost table and a value table (run `recguide "
                          "profile` and `recguide calibrate`): using the largest candidate block", stacklevel=3)
        elif self.auto:
            _check_covered("cost table (`recguide profile`)", self.candidates, costs.block_sizes)
            _check_covered("value table (`recguide calibrate`)", [b for b in self.candidates if b > 1],
                           values.block_sizes)
        self.hits, self.branch_rounds = 1.0, 3.0  # prior hit rate 1/3 until calibration or observation says more
        if values is not None and "coverage" in values.data:
            self.hits, self.branch_rounds = 3 * values.data["coverage"], 3.0
        self.segments_seen, self.segment_rows = 2.0, 1.0  # prior: two branch segments per row
        self.online = self.auto and config.online_costs and costs is not None and values is not None
        # the verifier-entropy pass per round is paid only where a value table bins it and trusts the bins
        self.reads_entropy = self.auto and values is not None and values.signal == "entropy" and values.reads_signal
        self.prices = prices if prices is not None else OnlinePrices()

    @classmethod
    def from_config(cls, config: DecodingConfig, base_dir=None, prices: OnlinePrices | None = None) -> BlockPolicy:
        from pathlib import Path

        def resolve(path):
            if path is None:
                return None
            p = Path(path)
            if not p.is_absolute() and base_dir is not None and (Path(base_dir) / p).exists():
                p = Path(base_dir) / p
            return p

        table = resolve(config.cost_table) if config.cost_table else None
        if table is not None and config.compile and compiled_table(table).exists():
            table = compiled_table(table)  # compiled forwards cost differently in kind (profile.py)
        costs = CostTable.load(table) if table is not None else None
        values = ValueTable.load(resolve(config.value_table)) if config.value_table else None
        return cls(config, costs, values, prices)

    # ------------------------------------------------------------------ block sizes
    def _load(self, c: int, factors: torch.Tensor) -> tuple[float, torch.Tensor]:
        """(rho_C, round seconds T_C(B) per candidate [K]) at c rows: the table's, once per c, times the
        online correction `factors` [K]."""
        if c not in self._at_load:
            self._at_load[c] = torch.tensor([self.costs.round_cost(c, b) for b in self.candidates],
                                            dtype=torch.float64)
        seconds = self._at_load[c] * factors
        rho = self.config.rho
        if rho is None:
            rho = max(self.values.mean[b] / t for b, t in zip(self.candidates, seconds.tolist()))
        return rho, seconds

    def _factors(self) -> torch.Tensor:
        """[K] measured / table price per candidate (1 when online is off)."""
        return torch.tensor([self.factor(b) for b in self.candidates], dtype=torch.float64)

    def factor(self, block: int) -> float:
        """How much dearer (> 1) or cheaper than the cost table rounds of `block` have been measured here."""
        if not self.online:
            return 1.0
        return self.prices.factor(block, self.config.online_optimism, self.config.online_prior)

    def observe_round(self, num_rows: int, block: int, seconds: float):
        """The engine's measured seconds for one bucket's round (`num_rows` rows at `block`)."""
        if self.online and seconds > 0:
            self.prices.observe(block, math.log(seconds / self.costs.round_cost(num_rows, block)))

    def plan(self, rows: torch.Tensor, stats, pending_has: torch.Tensor) -> torch.Tensor:
        """Planned block size [R] for the active rows: the best of a few whole-round plans (module docstring)."""
        if not self.auto:
            return torch.full_like(rows, self.candidates[0])
        if self.costs is None or self.values is None:
            return torch.full_like(rows, self.max_block)
        c = rows.numel()
        rc = rows.cpu()
        prev, full = stats.last_block[rc], stats.last_full[rc]
        if self.values.signal == "accepted":  # recent verification outcomes (calibrate.accepted_signal)
            n1, n2 = stats.last_accepted[rc].unbind(1)  # [R]; NaN: no such round yet, or a plain step
            s = accepted_signal(n1, n2, prev)  # as calibrated; no history: NaN, each block's mean
        else:  # minus the mean verifier entropy of the last two rounds
            e1, e2 = stats.entropy[rc].unbind(1)
            s = -(e1 + torch.where(e2.isnan(), e1, e2)) / 2  # [R]; NaN (no history) reads each block's mean
        value = self.values.values_matrix(self.candidates, s, prev, full).double()  # [R, K]
        factors = self._factors()  # once per round: the load's prices and every bucket's read them
        rho, seconds = self._load(c, factors)
        own = (value - rho * seconds).argmax(1)  # each request's own best block
        pinned = pending_has.cpu()[rc]  # a branch drafted these rows' next block, at their last size
        if not bool(pinned.any()):
            uniform = value.sum(0) - c * rho * seconds  # [K] every request at one block: one bucket
            k = int(uniform.argmax())
            best, best_gain = torch.full((c,), k), float(uniform[k])
            plans = [own] if bool((own != own[0]).any()) else []  # own plan = a uniform one: weighed already
        else:
            pinned_at = torch.searchsorted(self._sizes, prev.clamp(max=self.max_block))
            best, best_gain = None, -float("inf")
            plans = [torch.where(pinned, pinned_at, plan)
                     for plan in [torch.full((c,), k) for k in range(len(self.candidates))] + [own]]
        factors = factors.tolist()
        for plan in plans:
            counts = torch.bincount(plan, minlength=len(self.candidates)).tolist()
            bucket_seconds = sum(self.costs.round_cost(n, b) * f
                                 for n, b, f in zip(counts, self.candidates, factors) if n)
            gain = float(value.gather(1, plan[:, None]).sum()) - c * rho * bucket_seconds
            if gain > best_gain:
                best, best_gain = plan, gain
        return self._sizes[best].to(rows.device)

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


def _check_covered(what: str, wanted: list[int], have: list[int]):
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise ValueError(f"recguide_block_sizes asks for {missing}, which the {what} does not cover (it has "
                         f"{sorted(have)}); measure them or choose from those")
