"""Per-request and total decoding statistics (docs/algorithm.md §6), returned as `recguide_stats`: telemetry
only; nothing reads them back to decide (the policy keeps its own signals, policy.Signals).

Definitions:
* forwards: decode forward calls (prefill excluded; a fused verify + branches call counts once). Per
  request: the forwards it took part in. In total: batched calls issued.
* tpf: new tokens / forwards a request took part in (in total: summed over requests), so it means the
  same at every batch size; tau: new tokens per round; query_tokens: tokens fed to the backbone.
* hits: reused branches per kind; coverage: rounds whose next block came from a hit; forwards_saved:
  draft forwards avoided (one per hit).
"""

from __future__ import annotations

from collections import Counter

import torch

from .branches import KIND_NAMES


class Stats:
    def __init__(self, num_rows: int):
        z = lambda: torch.zeros(num_rows, dtype=torch.long)  # noqa: E731
        self.new_tokens, self.forwards, self.rounds, self.query_tokens = z(), z(), z(), z()
        self.accepted, self.drafted, self.branch_rounds = z(), z(), z()
        self.hits = torch.zeros(num_rows, len(KIND_NAMES), dtype=torch.long)
        self.block_sizes = [Counter() for _ in range(num_rows)]
        self.total_forwards = 0
        self.total_query_tokens = 0
        self.bucket_rounds: Counter = Counter()  # (rows, block) -> bucket rounds run: what a cost table prices
        self.round_log: list[tuple] | None = None  # [] to log (row, block, accepted, drafts, entropy, first place's)

    def reset_rows(self, rows: torch.Tensor):
        """A slot starts a new request: clear its per-request counters and signals."""
        rows = rows.cpu()
        for t in (self.new_tokens, self.forwards, self.rounds, self.query_tokens, self.accepted, self.drafted,
                  self.branch_rounds, self.hits):
            t[rows] = 0
        for r in rows.tolist():
            self.block_sizes[r] = Counter()

    def row_summary(self, row: int) -> dict:
        return self._summary(row)

    def record_forward(self, rows: torch.Tensor, query_len: int):
        rows = rows.cpu()
        self.forwards[rows] += 1
        self.query_tokens[rows] += query_len
        self.total_forwards += 1
        self.total_query_tokens += query_len * rows.numel()

    def record_round(self, rows, block: int, emitted, num_accepted, draft_len, hit_kind, had_branches: bool,
                     entropy, first_entropy=None):
        rows = rows.cpu()
        self.bucket_rounds[(rows.numel(), block)] += 1
        self.rounds[rows] += 1
        self.new_tokens[rows] += emitted.cpu()
        self.accepted[rows] += num_accepted.cpu()
        self.drafted[rows] += draft_len.cpu()
        if had_branches:
            self.branch_rounds[rows] += 1
        kind = hit_kind.cpu()
        hit = kind >= 0
        self.hits[rows[hit], kind[hit]] += 1
        for r in rows.tolist():
            self.block_sizes[r][block] += 1
        if self.round_log is not None:
            nan = [float("nan")] * rows.numel()
            ents = entropy.tolist() if entropy is not None else nan
            # a plain step's entropy is already its first place's
            firsts = first_entropy.tolist() if first_entropy is not None else (ents if block == 1 else nan)
            for r, n, k, e, f in zip(rows.tolist(), num_accepted.tolist(), draft_len.tolist(), ents, firsts):
                self.round_log.append((r, block, n, k, e, f))

    def _summary(self, idx) -> dict:
        new = int(self.new_tokens[idx].sum())
        fwd = int(self.forwards[idx].sum())
        rounds = int(self.rounds[idx].sum())
        branch_rounds = int(self.branch_rounds[idx].sum())
        hits = self.hits[idx].sum(0) if self.hits[idx].dim() > 1 else self.hits[idx]
        num_hits = int(hits.sum())
        sizes = Counter()
        for i in ([idx] if isinstance(idx, int) else idx):
            sizes.update(self.block_sizes[i])
        return {
            "new_tokens": new, "forwards": fwd, "rounds": rounds,
            "tpf": new / fwd if fwd else 0.0, "tau": new / rounds if rounds else 0.0,
            "query_tokens": int(self.query_tokens[idx].sum()),
            "accepted_drafts": int(self.accepted[idx].sum()), "drafted": int(self.drafted[idx].sum()),
            "hits": {name: int(hits[i]) for i, name in enumerate(KIND_NAMES)},
            "branch_rounds": branch_rounds,
            "coverage": num_hits / branch_rounds if branch_rounds else 0.0,
            "no_hit_rate": 1 - num_hits / branch_rounds if branch_rounds else 0.0,
            "forwards_saved": num_hits,
            "block_sizes": {int(k): v for k, v in sorted(sizes.items())},
        }

    def as_dict(self) -> dict:
        n = self.new_tokens.shape[0]
        total = self._summary(list(range(n)))
        total["request_forwards"] = total["forwards"]
        total["forwards"] = self.total_forwards
        total["total_query_tokens"] = self.total_query_tokens
        total["per_request"] = [self._summary(i) for i in range(n)]
        return total


def branch_status(branches_enabled: bool, summary: dict) -> str:
    """One line saying whether RecGuide's branches rode in the verify forwards, and if not, why."""
    if not branches_enabled:
        return "off (LinearSS, or recguide_overlap='off')"
    if summary["branch_rounds"]:
        share = summary["branch_rounds"] / summary["rounds"] if summary["rounds"] else 0.0
        return f"on in {share:.0%} of rounds, coverage {summary['coverage']:.0%}"
    if set(summary["block_sizes"]) <= {1}:
        return "off: every round was a plain decoding step (B = 1)"
    return ("off in every round: the cost table says their extra query tokens cost more than the draft forwards "
            "they would save at this hit rate (`recguide profile` measures it for this hardware)")
