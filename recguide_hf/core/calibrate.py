"""Fit the value table `V_B(s, z)` of the adaptive block-size policy (docs/algorithm.md §2.3).

Calibration runs LinearSS at the largest block size and logs, per request and round, the verifier
entropy `e_t` and the drafts accepted `n_t`. Because acceptance is a prefix, the same round at a smaller
block B would have accepted `min(n_t, B-1)` drafts, so one run at B_max yields the progress
`min(n_t, B-1) + 1` of every candidate B, and whether a previous block B' was fully accepted
(`n_{t-1} >= B'-1`). Then, for each B and each state `z = (B', F)`, V is the weighted mean progress per
bin of the certainty `s_t = -(e_{t-1} + e_{t-2}) / 2`. Each dataset gets equal total weight; quality is
reported out of fold (5 folds split by request).

The state after plain steps (B' = 1) is read on another scale: a plain step's entropy is that of ONE place,
the verifier's next token, while a block round's `e_t` averages the places up to its first mismatch (the
accepted ones mostly sure). So for B' = 1 the certainty is made from `f_t`, the entropy at the block's first
place, which the same calibration round logs: what a plain step at that point would have read.

The signal can instead be recent verification outcomes (`signal="accepted"`, `recguide calibrate --signal
accepted`): s_t = the mean drafts accepted in the last two rounds, each as a round at the state's block B' would
have seen it, min(n, B' - 1), and 0 after a plain step. `eval/signal_check.py` measures which of the two predicts
progress out of fold.

How far to trust the table is measured too, for its two parts apart: the state's mean `Z_B(z)` (what `z`
alone predicts) and the signal's bin within the state, `V_B(s, z) - Z_B(z)`. Out of fold, the outcome is regressed
on the first, `p - mean = lambda_z (Z - mean)`, then what is left on the second, `p - mean - lambda_z (Z - mean)
= lambda_s (V - Z)`, and the policy reads `mean + lambda_z (Z_B(z) - mean) + lambda_s (V_B(s, z) - Z_B(z))`,
each lambda clipped to [0, 1]. A part that predicts progress keeps its lambda near 1; one that does not is
shrunk away, so the policy does not act on noise: with an uninformative signal the table reads the state
alone (lambda_s = 0, and the policy then skips the signal's entropy pass), and with an uninformative state
too, every request gets the best block for its load. One lambda for both parts let an informative state carry
a signal's noise: on the bundled model the entropy bins (out-of-fold R^2 -0.004, `eval/signal_check.py`) kept
83% of their spread because whether the last block was fully accepted does predict progress.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Round:
    dataset: str
    request: int  # request id, unique within the dataset
    t: int  # round index within the request
    entropy: float  # e_t: mean verifier entropy over causally valid positions
    accepted: int  # n_t at the calibration block
    first_entropy: float | None = None  # f_t: verifier entropy at the block's first place (a plain step's reading)


SIGNALS = ("entropy", "accepted")  # what the per-request signal s_t is made of (module docstring)


def accepted_signal(n1: float, n2: float, b_prev: int) -> float:
    """s_t from recent verification outcomes: the mean drafts accepted in the last two rounds (n1 the last, n2 the
    one before; NaN for no reading: n2 NaN reads n1 alone, n1 NaN gives NaN), each as a round at block `b_prev`
    would have seen it (censored at b_prev - 1); 0 after a plain step (b_prev = 1), which drafts nothing. The
    calibration and the policy both read it here."""
    if b_prev == 1:
        return 0.0
    if math.isnan(n1):
        return math.nan
    cap = b_prev - 1
    return (min(n1, cap) + min(n1 if math.isnan(n2) else n2, cap)) / 2


def _samples(rounds: list[Round], block_sizes, weights_by_dataset, signal: str = "entropy"):
    """Rows (request key, s, B_prev, F_prev, progress per B, weight) for every round with history. A request's
    second round has one round behind it, and its signal reads that round twice, as the policy reads it."""
    by_req: dict[tuple, list[Round]] = {}
    for r in rounds:
        by_req.setdefault((r.dataset, r.request), []).append(r)
    out = []
    for key, rs in by_req.items():
        rs.sort(key=lambda r: r.t)
        for i in range(1, len(rs)):
            before = rs[i - 2] if i >= 2 else rs[i - 1]  # one round of history: the policy reads it twice
            s_block = -(rs[i - 1].entropy + before.entropy) / 2
            firsts = (rs[i - 1].first_entropy, before.first_entropy)
            s_plain = s_block if None in firsts or any(math.isnan(f) for f in firsts) else -sum(firsts) / 2
            progress = {b: min(rs[i].accepted, b - 1) + 1 for b in block_sizes}
            for b_prev in block_sizes:
                full = rs[i - 1].accepted >= b_prev - 1
                if signal == "accepted":
                    s = accepted_signal(float(rs[i - 1].accepted), float(before.accepted), b_prev)
                else:
                    s = s_plain if b_prev == 1 else s_block
                out.append((key, s, b_prev, full, progress, weights_by_dataset[key[0]]))
    return out


def fit(rounds: list[Round], block_sizes=(8, 16, 32), num_bins: int = 8, folds: int = 5, seed: int = 0,
        signal: str = "entropy") -> dict:
    """Fit V on all rounds and report out-of-fold prediction quality; `signal` (SIGNALS) is what s_t is."""
    if signal not in SIGNALS:
        raise ValueError(f"signal {signal!r}: expected one of {SIGNALS}")
    counts: dict[str, int] = {}
    for r in rounds:
        counts[r.dataset] = counts.get(r.dataset, 0) + 1
    weights = {d: 1.0 / n for d, n in counts.items()}
    samples = _samples(rounds, block_sizes, weights, signal)
    if not samples:
        raise ValueError("Calibration needs requests with at least two rounds")
    s_all = np.array([x[1] for x in samples])
    edges = np.unique(np.quantile(s_all, np.linspace(0, 1, num_bins + 1)[1:-1])).tolist()
    table = _fit_table(samples, block_sizes, edges)
    report = _out_of_fold(samples, block_sizes, edges, folds, seed)
    return {"block_sizes": list(block_sizes), "signal": signal, "s_edges": edges, "values": table["values"],
            "mean": table["mean"], "state_mean": table["state_mean"], "shrink_state": report.pop("shrink_state"),
            "shrink_signal": report.pop("shrink_signal"), "report": report, "first": _first_rounds(rounds, block_sizes,
                                                                                                   weights),
            "datasets": {d: n for d, n in counts.items()}}


def _first_rounds(rounds: list[Round], block_sizes, weights_by_dataset) -> dict[str, float]:
    """V_B of a request's first round (no history, right after its prompt): the mean progress of first rounds.
    They accept far fewer drafts than later rounds (the bundled model, B = 8: 2.2 to 3.6 tokens on the code and
    prose sets against 4.5 to 5.1 later), so the block's mean over all rounds would overrate them."""
    first = [r for r in rounds if r.t == 0]
    wsum = sum(weights_by_dataset[r.dataset] for r in first)
    return {str(b): sum(weights_by_dataset[r.dataset] * (min(r.accepted, b - 1) + 1) for r in first) / wsum
            for b in block_sizes} if wsum > 0 else {}


def _bin(s: float, edges) -> int:
    return int(np.searchsorted(edges, s, side="right"))


def _fit_table(samples, block_sizes, edges) -> dict:
    nb = len(edges) + 1
    values: dict = {}
    mean, state_mean = {}, {}
    for b in block_sizes:
        tot = sum(w * p[b] for _, _, _, _, p, w in samples)
        wsum = sum(w for *_, w in samples)
        mean[str(b)] = tot / wsum
        values[str(b)], state_mean[str(b)] = {}, {}
        for b_prev in block_sizes:
            for full in (False, True):
                num, den = np.zeros(nb), np.zeros(nb)
                for _, s, bp, f, p, w in samples:
                    if bp == b_prev and f == full:
                        k = _bin(s, edges)
                        num[k] += w * p[b]
                        den[k] += w
                # empty bins fall back to the state's mean, then the block's mean
                z = num.sum() / den.sum() if den.sum() > 0 else mean[str(b)]
                vals = np.where(den > 0, num / np.maximum(den, 1e-12), z)
                values[str(b)][f"{b_prev},{int(full)}"] = vals.tolist()
                state_mean[str(b)][f"{b_prev},{int(full)}"] = float(z)
    return {"values": values, "mean": mean, "state_mean": state_mean}


def _out_of_fold(samples, block_sizes, edges, folds, seed) -> dict:
    keys = sorted({x[0] for x in samples})
    rng = np.random.default_rng(seed)
    fold_of = {k: int(f) for k, f in zip(keys, rng.permutation(len(keys)) % folds)}
    # per test sample and block: (weight, outcome, block mean, state mean, bin value), all from the other folds
    preds: dict[int, list[tuple[float, float, float, float, float]]] = {b: [] for b in block_sizes}
    for f in range(folds):
        train = [x for x in samples if fold_of[x[0]] != f]
        test = [x for x in samples if fold_of[x[0]] == f]
        if not train or not test:
            continue
        fitted = _fit_table(train, block_sizes, edges)
        vt = ValueTable({"block_sizes": list(block_sizes), "s_edges": edges, "values": fitted["values"],
                         "mean": fitted["mean"]})  # unshrunk: the raw bins
        for _, s, bp, full, p, w in test:
            for b in block_sizes:
                z = fitted["state_mean"][str(b)].get(f"{bp},{int(full)}", vt.mean[b])
                preds[b].append((w, p[b], vt.mean[b], z, vt.value(b, s, bp, full)))
    out: dict = {"rmse": {}, "rmse_constant": {}, "r2_vs_constant": {}, "folds": folds, "shrink_state": {},
                 "shrink_signal": {}}
    for b in block_sizes:
        w, p, m, z, v = (np.array(col, dtype=float) for col in zip(*preds[b]))
        lam_z = _slope(w, p - m, z - m)
        lam_s = _slope(w, p - m - lam_z * (z - m), v - z)
        shrunk = m + lam_z * (z - m) + lam_s * (v - z)  # what the policy reads
        err, base = np.sum(w * (shrunk - p) ** 2), np.sum(w * (m - p) ** 2)
        out["rmse"][str(b)] = float(np.sqrt(err / w.sum()))
        out["rmse_constant"][str(b)] = float(np.sqrt(base / w.sum()))
        out["r2_vs_constant"][str(b)] = float(1 - err / base) if base > 0 else 0.0
        out["shrink_state"][str(b)], out["shrink_signal"][str(b)] = lam_z, lam_s
    return out


def _slope(w: np.ndarray, y: np.ndarray, x: np.ndarray) -> float:
    """Weighted least-squares slope of y on x through the origin, clipped to [0, 1] (0 when x never varies)."""
    spread = float(np.sum(w * x * x))
    return float(np.clip(np.sum(w * x * y) / spread, 0.0, 1.0)) if spread > 1e-12 else 0.0


class ValueTable:
    """Lookup of V_B(s, z) as the policy reads it: `mean + lambda_z (Z(z) - mean) + lambda_s (V(s, z) - Z(z))`
    (module docstring). Tables from before the two-part shrink carry one `shrink` lambda for both parts and no
    state means (read `mean + lambda (V - mean)`, as they were); a table without any reads its bins raw.
    `V_1 = 1` exactly (a plain decoding step), whether or not it was calibrated."""

    def __init__(self, data: dict):
        self.data = data
        self.block_sizes = [int(b) for b in data["block_sizes"]]
        self.edges = data["s_edges"]
        self.signal = data.get("signal", "entropy")  # tables from before the choice binned the entropy signal
        self.values = data["values"]
        self.mean = {int(b): v for b, v in data["mean"].items()} | {1: 1.0}
        # a request's first round (no history); tables from before it read the block's mean there
        self.first = self.mean | {int(b): v for b, v in data.get("first", {}).items()} | {1: 1.0}
        self.state_mean = {int(b): v for b, v in data.get("state_mean", {}).items()}
        # sigma_B: how far a round's progress strays from what the table predicts (out of fold; 0 where unmeasured)
        self.spread = {int(b): float(v) for b, v in data.get("report", {}).get("rmse", {}).items()}
        if "shrink_state" in data:
            self.shrink_state = {int(b): float(v) for b, v in data["shrink_state"].items()}
            self.shrink_signal = {int(b): float(v) for b, v in data["shrink_signal"].items()}
        else:  # one lambda for both parts (state means absent: the state part is then 0)
            self.shrink_state = self.shrink_signal = {int(b): float(v) for b, v in data.get("shrink", {}).items()}
        # whether any block's values move with s_t at all (lambda_s > 0): if not, the signal need not be read
        self.reads_signal = any(self.shrink_signal.get(b, 1.0) > 0 for b in self.block_sizes if b > 1)
        # per block: [previous blocks, fully accepted?, s bins] for the vectorised lookup; a previous block the
        # table does not know reads index -1 (`_prev_lut` maps block sizes 0..64 to table indices)
        self._prev_lut = torch.full((65,), -1, dtype=torch.long)
        for i, b in enumerate(self.block_sizes):
            self._prev_lut[b] = i
        missing = [None] * (len(self.edges) + 1)  # a state the table lacks reads the block's mean
        self._grid = {b: torch.tensor([[[self._shrunk(b, v, f"{bp},{f}")
                                         for v in self.values[str(b)].get(f"{bp},{f}", missing)]
                                        for f in (0, 1)] for bp in self.block_sizes], dtype=torch.float32)
                      for b in self.block_sizes}
        self._edges = torch.tensor(self.edges, dtype=torch.float32)
        self._stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # `row`'s plain-float reading: the lookup table, the bin edges as the tensor path compares them, its memo
        self._prev_list = self._prev_lut.tolist()
        self._edges_list = self._edges.double().tolist()
        self._rows: dict[tuple, tuple[float, ...]] = {}

    @classmethod
    def load(cls, path: str | Path) -> ValueTable:
        return cls(json.loads(Path(path).read_text()))

    def _shrunk(self, block: int, v: float | None, state: str) -> float:
        """One bin's value as the policy reads it (None, a state the table lacks: the block's mean)."""
        m = self.mean[block]
        if v is None:
            return m
        z = self.state_mean.get(block, {}).get(state, m)
        return m + self.shrink_state.get(block, 1.0) * (z - m) + self.shrink_signal.get(block, 1.0) * (v - z)

    def values_for(self, block: int, s: torch.Tensor, prev_block: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """`value` for many rows at once: s [R] float, prev_block [R] long, full [R] bool -> [R] float.
        A previous block the table does not know (or s NaN) gives the block's mean; no round yet (prev_block 0),
        the first round's."""
        return self.values_matrix([block], s, prev_block, full)[:, 0]

    def values_matrix(self, blocks: list[int], s: torch.Tensor, prev_block: torch.Tensor,
                      full: torch.Tensor) -> torch.Tensor:
        """`values_for` of several blocks in one lookup: -> [R, K] float (`row` reads it one request at a time)."""
        grid, means, firsts = self._stack(tuple(blocks))
        prev_idx = self._prev_lut[prev_block.clamp(0, 64)]
        known = (prev_idx >= 0) & (~s.isnan() | (not self.reads_signal))  # s unread: every bin reads alike
        known = known[:, None]
        bins = torch.bucketize(s.nan_to_num(0.0), self._edges, right=True)  # = np.searchsorted(side="right")
        v = grid[:, prev_idx.clamp(min=0), full.long(), bins].T  # [R, K]
        fallback = torch.where((prev_block == 0)[:, None], firsts[None, :], means[None, :])  # no round yet: first
        return torch.where(known, v, fallback)

    def _stack(self, blocks: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[K, P, 2, S] grids (V_1 = 1 everywhere), [K] means and [K] first rounds' means of `blocks`, built once."""
        if blocks not in self._stacked:
            shape = (len(self.block_sizes), 2, len(self.edges) + 1)
            grids = [torch.ones(shape) if b == 1 else self._grid[b] for b in blocks]
            self._stacked[blocks] = (torch.stack(grids), torch.tensor([self.mean[b] for b in blocks]),
                                     torch.tensor([self.first[b] for b in blocks]))
        return self._stacked[blocks]

    def row(self, blocks: tuple[int, ...], s: float, prev_block: int, full: bool) -> tuple[float, ...]:
        """`values_matrix` for one request as plain floats (the policy's per-round lookup, a few dict reads rather
        than a dozen tensor ops): the same numbers, memoised per state and signal bin."""
        prev_idx = self._prev_list[min(max(prev_block, 0), 64)]
        if prev_idx >= 0 and (s == s or not self.reads_signal):  # s == s: not NaN
            key = (blocks, prev_idx, full, bisect.bisect_right(self._edges_list, s if s == s else 0.0))
        else:  # no round yet (the first round's values) or a state the table lacks (the means)
            key = (blocks, prev_block == 0)
        got = self._rows.get(key)
        if got is None:
            grid, means, firsts = self._stack(blocks)
            if len(key) == 4:
                got = tuple(grid[:, prev_idx, int(full), key[3]].double().tolist())
            else:
                got = tuple((firsts if key[1] else means).double().tolist())
            self._rows[key] = got
        return got

    def value(self, block: int, s: float | None, prev_block: int | None, full: bool | None) -> float:
        if block == 1:
            return 1.0
        if prev_block in (None, 0):  # the request's first round
            return self.first.get(block, 0.0)
        if str(block) not in self.values or (s is None and self.reads_signal):
            return self.mean.get(block, 0.0)
        s = 0.0 if s is None else s  # a table that does not read the signal: every bin reads alike
        state = f"{prev_block},{int(bool(full))}"
        per_state = self.values[str(block)].get(state)
        if per_state is None:
            return self.mean[block]
        return self._shrunk(block, per_state[_bin(s, self.edges)], state)
