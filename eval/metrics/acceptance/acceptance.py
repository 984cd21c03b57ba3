"""Acceptance: tau, TPF and draft acceptance from RecGuide's per-request `recguide_stats`.

Load offline from the repository: `evaluate.load("eval/metrics/acceptance")`. Field definitions are those of
recguide_hf/core/stats.py (`output.recguide_stats["per_request"]` from
`model.generate(..., return_dict_in_generate=True)`).
"""

from __future__ import annotations

import datasets
import evaluate

FIELDS = ("new_tokens", "forwards", "rounds", "accepted_drafts", "drafted")

_DESCRIPTION = """\
Pools per-request decoding statistics: TPF = new tokens / forwards the requests took part in (the same at every
batch size), tau = new tokens / rounds, acceptance = accepted draft tokens / drafted tokens. Pooled means ratios of
sums (each token weighs the same); the mean of the per-request ratios is reported too."""

_KWARGS_DESCRIPTION = """
Args:
    new_tokens, forwards, rounds, accepted_drafts, drafted: one integer per request (the fields of a
        `recguide_stats["per_request"]` entry); or call `compute_stats(per_request)` with the dicts themselves.
Returns:
    requests, new_tokens, forwards, rounds: totals.
    tpf, tau, acceptance: pooled ratios (0.0 when the denominator is 0).
    mean_request_tpf, mean_request_tau: means of the per-request ratios (requests with 0 forwards/rounds skipped).
Examples:
    >>> acceptance = evaluate.load("eval/metrics/acceptance")
    >>> acceptance.compute_stats([{"new_tokens": 8, "forwards": 2, "rounds": 2, "accepted_drafts": 6,
    ...                            "drafted": 14}])["tpf"]
    4.0
"""


def columns(per_request: list[dict]) -> dict:
    """The metric's inputs (one list per field) from per-request stats dicts."""
    return {field: [int(s[field]) for s in per_request] for field in FIELDS}


def _ratio(a, b) -> float:
    return a / b if b else 0.0


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Acceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({field: datasets.Value("int64") for field in FIELDS}),
        )

    def compute_stats(self, per_request: list[dict]) -> dict:
        """`compute` from per-request stats dicts (extra keys such as `hits` are ignored)."""
        return self.compute(**columns(per_request))

    def _compute(self, new_tokens, forwards, rounds, accepted_drafts, drafted):
        total = lambda xs: int(sum(xs))  # noqa: E731
        tpfs = [n / f for n, f in zip(new_tokens, forwards) if f]
        taus = [n / r for n, r in zip(new_tokens, rounds) if r]
        return {
            "requests": len(new_tokens),
            "new_tokens": total(new_tokens), "forwards": total(forwards), "rounds": total(rounds),
            "tpf": _ratio(total(new_tokens), total(forwards)),
            "tau": _ratio(total(new_tokens), total(rounds)),
            "acceptance": _ratio(total(accepted_drafts), total(drafted)),
            "mean_request_tpf": _ratio(sum(tpfs), len(tpfs)),
            "mean_request_tau": _ratio(sum(taus), len(taus)),
        }
