"""Block sizes per request and round, bucketing, and whether a forward carries branches: one scheduler.

Fixed mode: every request uses the configured B (B = 1: plain decoding steps in the engine).

"auto" (docs/algorithm.md §2.3), one rule (a static batch's is below): each round, the plan (a block size for every
active request) with the most expected tokens per second, `sum_r V_B_r(s_r, z_r) / sum_buckets T_n(B)`, where
* the candidates are the block sizes the cost table measured on this hardware (`recguide profile`), by
  default {1, 2, 4, 8, 16, 32, 64}; `recguide_block_sizes` narrows them (the paper's set: [8, 16, 32]);
* `V_B(s, z)` is the calibrated expected progress (tokens per round) given the signal `s_t` and state
  `z_t = (B_{t-1}, fully accepted?)`, shrunk toward the block's mean as far as it failed to predict out of
  fold (calibrate.py); without history it is the mean. The value table says what `s_t` is: minus the mean
  verifier entropy of the last two rounds (docs/algorithm.md §2.3's certainty), or the mean drafts they accepted, each
  capped at B_{t-1} - 1 (recent verification outcomes; 0 after a plain step), which needs no entropy pass;
  `V_1 = 1` exactly: a plain step always yields one token;
* near its limit (max_new_tokens) a request's round is worth only min(V_B, r) of the r tokens it may still
  emit, less what its leftover will cost beyond the steady rate when that leftover is shorter than a round
  of the best steady block (one more round must still be paid for it: `_to_the_limit`). A request one token
  from its limit takes a plain step; one a round away finishes in this round; far from it nothing changes;
* `T_n(B)` is the measured seconds of a LinearSS round of block B for n rows: its draft and verify
  forwards plus the engine's own work around them (profile.py); `T_n(1)` is one plain decoding step (no
  draft forward). Requests are bucketed by B, one
  draft and one verify forward per bucket, so the round costs the SUM over its buckets: splitting a batch
  is priced, and on hardware where a forward has a large fixed cost a split must earn it;
* that is the paper's `argmax V_B - rho T(B)` with rho at the round's own best rate, the rate these requests'
  states allow, rather than `rho_C = max_B mean(V_B) / T_C(B)`, the best fixed block's rate on average. A hard
  stretch of text (a state in which every block accepts little) lasts so many tokens, not so much time: a plain
  step does not leave it sooner, so what a round's time is worth there is the rate those tokens can be made at.
  Valued at the average rate, time looked dear in exactly those stretches and the policy took plain steps
  through them where a block round still made its tokens faster (on the CPU at C = 1: 46% plain rounds, x0.88
  of linear-16). Where plain steps are fastest on average (high load) the two agree: a block is chosen only
  where its rate beats a plain step's. `recguide_rho` set to a number weighs time by it instead: the plan with
  the most `sum V - C rho T` (rho = 0: the most tokens per round, whatever they cost);
  `rho_C` still prices a request's last tokens (`_to_the_limit`);
* online (`recguide_online_costs`, on by default): the table was measured on static batches at one prefix
  length, while a served call has other lengths, admissions and a busy host. The engine times every
  bucket's round; `g` is the running mean of log(measured / table) over all rounds and `d_B` that of B's
  rounds above `g`, and after n_B rounds of B, with w = n_B / (n_B + prior), `T_n(B)` reads the table's
  price times exp(g + w d_B - (1 - w) u). Only the per-B part can change a plan (a factor common to every
  B scales every plan's time alike). `u` (`recguide_online_optimism`, 0.03) is optimism for what has not been
  measured: a size within ~3% of the best gets tried and is then read as measured, while a size the table
  prices far worse is never tried. `prior` (`recguide_online_prior`, 8 rounds) is the table's weight. The
  defaults come from a sweep on the bundled model (docs/how-it-works.md): the measured relative prices stayed within a
  few percent of the table's, and larger optimism (0.1, prior 16) made near-tied sizes alternate and cost
  up to 10% at C = 16. `generate` keeps these prices on the model from call to call (short calls then
  learn from the earlier ones); each `recguide bench` run starts afresh.
* online values (`recguide_online_values`, on by default): the value table was fitted on the calibration
  prompts, and unseen prompts accept more or fewer drafts (on held-out HumanEval the bundled table predicted
  4.69 tokens a round at B = 8 where rounds made 4.01). Every round of B > 1 compares the drafts its rows
  accepted with the drafts the table predicted for them (`V_B - 1`, rows whose block their limit did not cut);
  `a` = accepted / predicted over the call's rounds, shrunk toward 1 by `VALUE_PRIOR` predicted drafts. One
  ratio for every block size, not one per size: the plan gives a size the rows the table rates highest for
  it, which are also the rows where the table errs high (its cells err both ways on unseen prompts), so a
  per-size ratio learnt from them under-rated that size everywhere and, no longer chosen, it never learnt
  otherwise (under the B200 table at C = 2, a_16 fell to 0.80 within a few rounds and B = 16 was not chosen
  again: 794 tok/s against linear-16's 828, whose own rounds made what the table predicted to 1%).
  The plan then reads `V'_B = 1 + a (V_B - 1)` (within [1, B]), and rho the corrected means. Old rounds
  fade with every row-round that follows (`VALUE_HORIZON`), plain steps included, so a server follows its
  prompts and a policy that fell back to B = 1 drifts back toward the table and drafts again; `generate`
  keeps the correction with the prices.
The policy learns only through `observe(RoundOutcome)`, one call per bucket round: the slots' signals
(`Signals`: the state and signal `V_B` reads), the measured price, the acceptance, the branch hit rate.

One static batch (`generate`: the call returns when its last request is done, and a request that finishes early
frees a slot no other request takes) is timed by its slowest request, not by tokens per second: a round that
races a confident request ahead while the batch waits on an unsure one buys nothing. There, for C > 1, the plan
is every request at the one B that minimises `T_C(B) max_r n_B(r)`, the time the batch would take to finish at
that B: the block its laggard makes its tokens fastest at, the cheapest round where every block gives it the same.
`n_B(r)` is the rounds request r needs for the m_r tokens it may still emit, were it the unluckiest of the C: a
round's progress strays `sigma_B` (the value table's out-of-fold RMSE) from `V_B(r)`, independently round to round,
so n rounds make `n V_B - z_C sigma_B sqrt(n)`, z_C the mean largest of C standard normals (1.77 at 16; V and
sigma scaled alike by the online ratio); `n_B(r)` solves that for m_r (m_r / V_B at sigma = 0, and for B = 1: a
plain step makes its token for sure). (On held-out HumanEval at C = 4, rounds of B = 16 cost 33% more than
B = 8's, yet recguide's static batches took as many rounds as linear-8's: 81. At C = 16, planned for the mean
request, a B = 8 round was tried where its 16 rows made less than plain steps would have.) One
request (C = 1) is its own batch and keeps the rate rule, whose last rounds `_to_the_limit` prices; a server's
slots keep it too (a freed slot takes the next request), and so does `recguide_rho` set to a number (a weight on time
is a rate's rule). `Engine.serve`, a closed loop over a known list, keeps it until its last prompt is admitted; the
requests then in flight are one static batch, done with its slowest. (With the rate rule there, a closed loop at
C = 32 that had drafted ran its last requests, out of step, at about 1,000 tokens/s at table prices against 1,416
for plain steps in step: eval/closed_loop_drain.py.) Rows a branch pinned keep their drafted block.

The plans weighed are: every request at the same B, for each candidate B, and every request at its own
`argmax_B V_B / T_C(B)`. A request's first round (no history) reads `V_B` of first rounds,
calibrated apart: right after a prompt far fewer drafts are accepted than later. B = 1 is the
fallback that keeps decoding from being slower than plain steps: whenever drafts are not worth their
forward at this load the round is a plain step, and the round after may speculate again. No threshold on
concurrency appears anywhere: load enters only through the measured `T`.

Branches (docs/algorithm.md §2.2) ride in a verify forward only when the measured costs say they pay: the extra
query tokens cost `T_verify(C, B, S) - T_verify(C, B, 0)` for S segments per row, and they save an expected
`T_draft(C, B) - E T_draft(M, B)`, M ~ Binomial(C, 1 - h) the rows whose branch missed, which the next draft
forward still covers (h = branch hit rate, observed during the call; prior from calibration). Where a forward
costs the same for 1 row as for C (memory-bound), that is about h^C T_draft: only all rows hitting saves it. At low load
the extra tokens are nearly free and branches stay; as load grows they are dropped, by the same rule.
Without a cost table branches are always carried.
"""

from __future__ import annotations

import bisect
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import torch

from .calibrate import ValueTable, accepted_signal
from .config import PAPER_BLOCK_SIZES, DecodingConfig
from .costs import CostTable, compiled_table

ONLINE_RATE = 0.05  # weight of the newest round in the running means of log(measured / table seconds)
VALUE_PRIOR = 16.0  # the value table's weight, in drafts it predicted accepted, against what the call observes
VALUE_HORIZON = 4096.0  # observations fade by exp(-row-rounds since / this), plain steps too: prompts drift


@dataclass
class RoundOutcome:
    """What one bucket's round did: everything the policy learns from (`BlockPolicy.observe`)."""

    rows: torch.Tensor  # [R] the bucket's request slots
    block: int
    accepted: torch.Tensor  # [R] drafts accepted (0 in a plain step)
    drafts: torch.Tensor  # [R] drafts verified: block - 1, fewer where a request's limit cut the block
    entropy: torch.Tensor | None = None  # [R] mean verifier entropy (only where the policy reads it)
    seconds: float | None = None  # the bucket's measured round time (None: not timed)
    branch_hits: int | None = None  # branches reused for the next round; None: no branch rode in this round
    branch_segments: int = 0


class Signals:
    """Per request slot, what its recent rounds say: the state `z_t` and the signal `s_t` that `V_B(s, z)` reads."""

    def __init__(self, num_rows: int):
        self.entropy = torch.full((num_rows, 2), float("nan"))  # mean verifier entropy, last two rounds
        self.last_accepted = torch.full((num_rows, 2), float("nan"))  # drafts accepted, last two rounds
        self.last_block = torch.zeros(num_rows, dtype=torch.long)  # 0: no round yet
        self.last_full = torch.zeros(num_rows, dtype=torch.bool)
        self.expected = torch.full((num_rows,), float("nan"))  # drafts the value table predicted accepted

    def reset_rows(self, rows: torch.Tensor):
        rows = rows.cpu()
        for t in (self.entropy, self.last_accepted, self.expected):
            t[rows] = float("nan")
        self.last_block[rows] = 0
        self.last_full[rows] = False

    def record(self, out: RoundOutcome):
        rows, accepted = out.rows.cpu(), out.accepted.cpu()
        self.last_accepted[rows, 1] = self.last_accepted[rows, 0]
        # a plain step drafted nothing: it tells nothing about acceptance (NaN), rather than "none accepted"
        self.last_accepted[rows, 0] = float("nan") if out.block == 1 else accepted.float()
        if out.entropy is not None:
            self.entropy[rows, 1] = self.entropy[rows, 0]
            self.entropy[rows, 0] = out.entropy.float().cpu()
        self.last_block[rows] = out.block
        self.last_full[rows] = accepted >= out.drafts.cpu()


class OnlinePrices:
    """The running correction of the cost table by measured round times (module docstring, "online"). One
    lives as long as its owner wants: `generate` keeps one per model and cost table across calls."""

    def __init__(self):
        self.common, self.rounds = 0.0, 0  # g: running mean of log(measured / table seconds), every round
        self.above: dict[int, float] = {}  # d_B: running mean of B's log ratio above g
        self.seen: dict[int, int] = {}  # n_B: rounds of B measured
        self.values = OnlineValues()  # the value table's correction, kept alongside for the same owner

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


class OnlineValues:
    """Drafts accepted against drafts the value table predicted, over the rounds that drafted (module docstring,
    "online values"): the table was fitted on the calibration prompts, and served prompts accept more or less."""

    def __init__(self):
        self.made = 0.0  # faded sum of drafts accepted
        self.expected = 0.0  # faded sum of drafts the table predicted accepted

    def fade(self, row_rounds: int):
        """Older rounds weigh less as rounds go by (plain steps included, so a policy that settled on B = 1 on
        hard prompts drifts back toward the table and tries drafting again)."""
        f = math.exp(-row_rounds / VALUE_HORIZON)
        self.made *= f
        self.expected *= f

    def observe(self, expected: float, made: float):
        self.made += made
        self.expected += expected

    def scale(self) -> float:
        """a: observed / predicted drafts accepted, shrunk toward 1 (the table) by VALUE_PRIOR drafts."""
        return (self.made + VALUE_PRIOR) / (self.expected + VALUE_PRIOR)


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
        self._at_load: dict[tuple[int, int], float] = {}  # (rows, B) -> the table's T_rows(B)
        if self.auto and (costs is None or values is None):
            warnings.warn("recguide_block_size='auto' without a cost table and a value table (run `recguide "
                          "profile` and `recguide calibrate`): using the largest candidate block", stacklevel=3)
        elif self.auto:
            _check_covered("cost table (`recguide profile`)", self.candidates, costs.block_sizes)
            _check_covered("value table (`recguide calibrate`)", [b for b in self.candidates if b > 1],
                           values.block_sizes)
            # [K] the value table's mean progress per candidate (V_1 = 1), read by rho every round
            self._means = [float(values.mean[b]) for b in self.candidates]
        self.hits, self.branch_rounds = 1.0, 3.0  # prior hit rate 1/3 until calibration or observation says more
        if values is not None and "coverage" in values.data:
            self.hits, self.branch_rounds = 3 * values.data["coverage"], 3.0
        self.segments_seen, self.segment_rows = 2.0, 1.0  # prior: two branch segments per row
        self.online = self.auto and config.online_costs and costs is not None and values is not None
        # the verifier-entropy pass per round is paid only where a value table bins it and trusts the bins
        self.reads_entropy = self.auto and values is not None and values.signal == "entropy" and values.reads_signal
        self.prices = prices if prices is not None else OnlinePrices()
        # the value table corrected by the acceptance observed (module docstring, "online values")
        self.learns_values = self.auto and config.online_values and costs is not None and values is not None
        self.signals = Signals(0)
        self.whole_batch = False

    @classmethod
    def from_config(cls, config: DecodingConfig, base_dir=None, prices: OnlinePrices | None = None) -> BlockPolicy:
        values = ValueTable.load(_resolve(config.value_table, base_dir)) if config.value_table else None
        return cls(config, cost_table_of(config, base_dir), values, prices)

    # ------------------------------------------------------------------ what rounds did
    def start(self, num_rows: int):
        """A call (or a server's slot table) of `num_rows` request slots begins: no history in any slot. The engine
        then sets `whole_batch`: True for one static batch (`Engine.generate`), done when its last request is
        (module docstring), False for slots that take the next request."""
        self.signals = Signals(num_rows)
        self.whole_batch = False

    def reset_rows(self, rows: torch.Tensor):
        """Slots that start a new request forget the old one's rounds."""
        self.signals.reset_rows(rows)

    def observe(self, out: RoundOutcome):
        """Learn from one bucket's round: the slots' signals, the measured price of the round, the acceptance
        against what the value table predicted, and the branch hit rate."""
        self.signals.record(out)
        if self.online and out.seconds is not None and out.seconds > 0:
            self.prices.observe(out.block, math.log(out.seconds / self._table_price(out.rows.numel(), out.block)))
        if self.learns_values:
            self.prices.values.fade(out.rows.numel())
        if self.learns_values and out.block > 1:
            rows, drafts = out.rows.cpu(), out.drafts.cpu()
            expected = self.signals.expected[rows]
            whole = (drafts == out.block - 1) & ~expected.isnan()  # a block its request's limit cut says less
            if bool(whole.any()):
                self.prices.values.observe(float(expected[whole].sum()), float(out.accepted.cpu()[whole].sum()))
        if out.branch_hits is not None:
            self.hits += out.branch_hits
            self.branch_rounds += out.rows.numel()
            self.segments_seen += out.branch_segments
            self.segment_rows += out.rows.numel()

    # ------------------------------------------------------------------ block sizes
    def _round_prices(self, c: int) -> list[float]:
        """T_C(B) per candidate [K] at c rows: the table's (looked up once per (c, B)) times the online correction.
        Plain floats: a plan runs every round, and K small tensors' dispatch cost more than their arithmetic
        (on the CPU the policy's host time was 3% of a round at C = 1)."""
        return [self._table_price(c, b) * self.factor(b) for b in self.candidates]

    def _table_price(self, c: int, block: int) -> float:
        """The cost table's T_c(B), looked up once per (c, B)."""
        key = (c, block)
        if key not in self._at_load:
            self._at_load[key] = self.costs.round_cost(c, block)
        return self._at_load[key]

    def factor(self, block: int) -> float:
        """How much dearer (> 1) or cheaper than the cost table rounds of `block` have been measured here."""
        if not self.online:
            return 1.0
        return self.prices.factor(block, self.config.online_optimism, self.config.online_prior)

    def value_scale(self, block: int) -> float:
        """a: how much more (> 1) or less than the value table predicted drafting rounds have accepted (1 for
        B = 1: a plain step always yields one token)."""
        if not self.learns_values or block == 1:
            return 1.0
        return self.prices.values.scale()

    def plan(self, rows: torch.Tensor, pending_has: torch.Tensor,
             remaining: torch.Tensor | None = None) -> torch.Tensor:
        """Planned block size [R] for the active rows: the best of a few whole-round plans (module docstring).
        `remaining` [R]: the tokens each request may still emit (None: unbounded; `_to_the_limit`).

        Plain floats throughout: R x K numbers (K candidates) are read and compared once per round, where tensor
        ops cost their dispatch, not their arithmetic (the plan was 2-4% of a round on the CPU at C = 1 and 16)."""
        if not self.auto:
            return torch.full_like(rows, self.candidates[0])
        if self.costs is None or self.values is None:
            return torch.full_like(rows, self.max_block)
        rc = rows.cpu()
        c = rc.numel()
        sig = self.signals
        prev, full = sig.last_block[rc].tolist(), sig.last_full[rc].tolist()
        if self.values.signal == "accepted":  # recent verification outcomes (calibrate.accepted_signal)
            # 0 after a plain step (the state's cells, which read the block's mean under this signal); NaN with
            # no round yet (the first round's value)
            s = [accepted_signal(n1, n2, b) for (n1, n2), b in zip(sig.last_accepted[rc].tolist(), prev)]
        else:  # minus the mean verifier entropy of the last two rounds (NaN, no history: the first round's value),
            e1, e2 = sig.entropy[rc].unbind(1)  # in float32 as calibrated: the bins' edges compare it so
            s = (-(e1 + torch.where(e2.isnan(), e1, e2)) / 2).tolist()
        sizes = self.candidates
        k_all = range(len(sizes))
        key = tuple(sizes)
        # [R][K] V_B: requests in one state and signal bin share one (memoised) tuple, so what is
        # worked out from a row is worked out once per distinct row (keyed by id: every row lives through the plan)
        table = [self.values.row(key, si, p, f) for si, p, f in zip(s, prev, full)]
        value, means = table, self._means
        a = self.prices.values.scale() if self.learns_values else 1.0  # the online ratio (1: the table as is)
        if self.learns_values:  # V'_B = 1 + a (V_B - 1) within [1, B]: one ratio a for every B > 1 (B = 1 reads 1)
            value = _per_distinct(table, lambda row: [_within(1 + a * (v - 1), b) for v, b in zip(row, sizes)])
            means = [_within(1 + a * (m - 1), b) for m, b in zip(means, sizes)]
        seconds = self._round_prices(c)  # once per round: the load's prices and every bucket's read them
        weight = self.config.rho  # None: tokens per second; a number: tokens less weight x C x seconds
        rho = weight if weight is not None else max(m / t for m, t in zip(means, seconds))
        unlimited = value
        left = remaining.tolist() if remaining is not None else None
        if left is not None:
            value = _to_the_limit(value, left, means, [rho * t for t in seconds])

        def score(tokens, seconds_):
            return tokens / seconds_ if weight is None else tokens - c * weight * seconds_

        def rate(row):  # a request's own best block: the most of its tokens per second (or worth less time)
            scores = [v / t for v, t in zip(row, seconds)] if weight is None else \
                [v - weight * t for v, t in zip(row, seconds)]
            return scores.index(max(scores))  # the first best, as argmax

        own = _per_distinct(value, rate)
        pinned = pending_has.cpu()[rc].tolist()  # a branch drafted these rows' next block, at their last size
        if any(pinned):  # the candidate index of each row's last block
            pinned_at = [bisect.bisect_left(sizes, min(b, self.max_block)) for b in prev]
        plans: list[list[int]] = []
        if self.whole_batch and c > 1 and weight is None and left is not None:
            # one static batch: the plan that finishes its slowest request soonest (module docstring); rows a
            # branch pinned keep their drafted block
            z = _largest_of(c)  # how far the slowest of c requests' progress falls below its mean, in spreads
            spread = [z * a * self.values.spread.get(b, 0.0) if b > 1 else 0.0 for b in sizes]
            most: dict[int, tuple] = {}  # per distinct row, the most tokens one of its requests may still emit
            for row, m in zip(unlimited, left):
                if id(row) not in most or m > most[id(row)][1]:
                    most[id(row)] = (row, m)
            need = [max(_rounds_to_make(m, row[k], spread[k]) for row, m in most.values()) for k in k_all]
            k = min(k_all, key=lambda k: need[k] * seconds[k])
            best = [at if pin else k for pin, at in zip(pinned, pinned_at)] if any(pinned) else [k] * c
        elif not any(pinned):
            uniform = [score(sum(col), t) for col, t in zip(zip(*value), seconds)]  # one bucket at each B
            k = max(k_all, key=uniform.__getitem__)
            best, best_gain = [k] * c, uniform[k]
            if any(o != own[0] for o in own):  # own plan = a uniform one: weighed already
                plans = [own]
        else:
            best, best_gain = None, -math.inf
            plans = [[at if pin else k for pin, at, k in zip(pinned, pinned_at, plan)]
                     for plan in [[k] * c for k in k_all] + [own]]
        if plans:
            factors = [self.factor(b) for b in sizes]
        for plan in plans:
            counts = [0] * len(sizes)
            for k in plan:
                counts[k] += 1
            bucket_seconds = sum(self._table_price(n, b) * f for n, b, f in zip(counts, sizes, factors) if n)
            gain = score(sum(row[k] for row, k in zip(value, plan)), bucket_seconds)
            if gain > best_gain:
                best, best_gain = plan, gain
        sig.expected[rc] = torch.tensor([row[k] - 1 for row, k in zip(table, best)])  # what the table alone said
        return torch.tensor([sizes[k] for k in best], dtype=rows.dtype, device=rows.device)

    def buckets(self, rows: torch.Tensor, pending_has: torch.Tensor, remaining: torch.Tensor | None = None):
        """Yield (block size, rows) groups: one draft and one verify forward per group."""
        planned = self.plan(rows, pending_has, remaining)
        for block in planned.unique().tolist():
            yield int(block), rows[planned == block]

    # ------------------------------------------------------------------ branches
    def branches_on(self, num_rows: int, block: int) -> bool:
        """Whether this verify forward should carry branches: expected draft time saved > extra verify time."""
        if self.costs is None:
            return True
        h = min(self.hits / self.branch_rounds, 1.0)
        segments = self.segments_seen / self.segment_rows
        extra = self.costs.verify(num_rows, block, segments) - self.costs.verify(num_rows, block, 0)
        return self._draft_saved(num_rows, block, h) > extra

    def _draft_saved(self, num_rows: int, block: int, h: float) -> float:
        """Expected draft seconds a round's branches save: the next draft forward runs over the rows whose branch
        missed (each hits with probability h), so it shrinks to T_draft(misses) and is skipped only when every
        row hit. Where a forward's cost is flat in its rows (memory-bound) that is about h^R T_draft, not
        h T_draft: at 4 rows and h = 1/3, branches cost more verify work than they save."""
        full = self.costs.draft(num_rows, block)
        expected = sum(math.comb(num_rows, k) * (1 - h) ** k * h ** (num_rows - k) * self.costs.draft(k, block)
                       for k in range(1, num_rows + 1))
        return full - expected


def cost_table_of(config: DecodingConfig, base_dir=None) -> CostTable | None:
    """The cost table `config` names (a relative path read from `base_dir`, a model folder, where it exists there; the
    compiled forwards' table beside it when `config.compile` and one was measured), or None."""
    if not config.cost_table:
        return None
    table = _resolve(config.cost_table, base_dir)
    if config.compile and compiled_table(table).exists():
        table = compiled_table(table)  # compiled forwards cost differently in kind (profile.py)
    return CostTable.load(table)


def _resolve(path, base_dir) -> Path:
    p = Path(path)
    if not p.is_absolute() and base_dir is not None and (Path(base_dir) / p).exists():
        p = Path(base_dir) / p
    return p


def _per_distinct(rows: list, f) -> list:
    """[f(row) for row in rows], f called once per distinct row object (the plan's rows in one state and signal bin
    share one memoised tuple; keyed by id, so every row must live through the call, as the plan's do)."""
    done: dict[int, object] = {}
    for row in rows:
        if id(row) not in done:
            done[id(row)] = f(row)
    return [done[id(row)] for row in rows]


def _largest_of(n: int) -> float:
    """E max of n standard normals (Blom's approximation, within 0.03 for n >= 2): 0.59 at 2, 1.77 at 16."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _rounds_to_make(tokens: float, value: float, spread: float) -> float:
    """Rounds the slowest request needs for `tokens` at `value` a round, when n rounds make n value - spread sqrt(n)
    (`spread` = z sigma_B: progress strays sigma_B a round, independently, and the slowest of the batch's requests
    falls z of its spreads below the mean): the root of n v - spread sqrt(n) = tokens, at least one round. With
    spread 0 (a plain step makes its token for sure; a table without a measured spread): tokens / value. sigma_B is
    the table's error over all its states, and rounds of one request are not independent (a hard stretch lasts):
    the slowest request's shortfall is, if anything, larger than this."""
    value = max(value, 1.0)
    if spread <= 0.0:  # exactly tokens / value, so a tie between sizes stays one
        return max(1.0, tokens / value)
    root = (spread + math.sqrt(spread * spread + 4.0 * value * tokens)) / (2.0 * value)
    return max(1.0, min(root * root, tokens))  # a round always makes a token: never more rounds than tokens


def _within(x: float, block: int) -> float:
    """x within [1, block] (a corrected value: at least the one token a round always yields, at most the block)."""
    return 1.0 if x < 1.0 else (block if x > block else x)


def _to_the_limit(value: list[list[float]], remaining: list[int], means: list[float], price: list[float]):
    """[R, K] a round's worth in tokens for requests that may emit only `remaining` [R] more: what it can emit,
    min(V_B, remaining), less what its leftover x = remaining - that will cost beyond the steady rate. The plan's
    rule values a round's tokens as if decoding went on for ever; near its limit a request has one more round to
    pay for its last x tokens (x below a round of the best steady block), whose cheapest round that makes x on
    average (`means` [K] >= x) costs `price` [K] = rho_C T_C(B) token-equivalents (rho_C: the best fixed block's
    rate) where the steady rate charged x. So a request one token from its limit takes a plain step, one a block's
    worth away finishes in this round, and far from its limit the rule is unchanged. A round worth nothing or
    less reads 0 (never negative: tokens per second would then prefer the longest round), so where every size is
    worth nothing the cheapest round is taken."""
    steady = means[max(range(len(means)), key=lambda k: means[k] / price[k])]  # a round of the best steady block
    out = []
    for row, m in zip(value, remaining):
        if m - max(row) >= steady and min(row) >= 0:  # far from its limit: every leftover a steady round away
            out.append(row)
            continue
        worth = []
        for v in row:
            made = min(v, m)
            x = m - made  # the leftover, and the cheapest round that makes it on average
            finish = min((p for mean, p in zip(means, price) if mean >= x), default=math.inf)
            extra = max(finish - x, 0.0) if 0 < x < steady and finish < math.inf else 0.0
            worth.append(max(made - extra, 0.0))
        out.append(worth)
    return out


def _check_covered(what: str, wanted: list[int], have: list[int]):
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise ValueError(f"recguide_block_sizes asks for {missing}, which the {what} does not cover (it has "
                         f"{sorted(have)}); measure them or choose from those")
