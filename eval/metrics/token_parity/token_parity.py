"""Token parity: do two decoders produce the same token ids? (e.g. `recguide_mode="recguide"` vs `"ar"`).

Load offline from the repository: `evaluate.load("eval/metrics/token_parity")`.
"""

from __future__ import annotations

import datasets
import evaluate

_DESCRIPTION = """\
Compares generated token-id sequences (predictions) with reference sequences (e.g. plain greedy `ar` output).
Reports the rate of exactly equal sequences and where they part: the common prefix length and, over the pairs
that differ, the first divergence position (0-based index of the first differing token; a sequence that is a
strict prefix of the other diverges at its end)."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of token-id lists (the decoder under test).
    references: list of token-id lists (the reference decoder).
Returns:
    exact_match: fraction of pairs with identical sequences.
    num_pairs, num_diverged: counts.
    mean_common_prefix: mean length of the common prefix over all pairs.
    mean_prefix_fraction: mean common prefix / reference length (1.0 for an empty reference).
    mean_first_divergence: mean first divergence position over the diverged pairs (None if none diverged).
    min_first_divergence: earliest divergence over the diverged pairs (None if none diverged).
Examples:
    >>> parity = evaluate.load("eval/metrics/token_parity")
    >>> parity.compute(predictions=[[1, 2, 3], [1, 2, 4]], references=[[1, 2, 3], [1, 2, 3]])["exact_match"]
    0.5
"""


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokenParity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "predictions": datasets.Sequence(datasets.Value("int64")),
                "references": datasets.Sequence(datasets.Value("int64")),
            }),
        )

    def _compute(self, predictions, references):
        prefixes, fractions, divergences = [], [], []
        for pred, ref in zip(predictions, references):
            pred, ref = list(pred), list(ref)
            n = common_prefix(pred, ref)
            prefixes.append(n)
            fractions.append(n / len(ref) if ref else 1.0)
            if pred != ref:
                divergences.append(n)
        pairs = len(prefixes)
        return {
            "exact_match": (pairs - len(divergences)) / pairs if pairs else 0.0,
            "num_pairs": pairs,
            "num_diverged": len(divergences),
            "mean_common_prefix": sum(prefixes) / pairs if pairs else 0.0,
            "mean_prefix_fraction": sum(fractions) / pairs if pairs else 0.0,
            "mean_first_divergence": sum(divergences) / len(divergences) if divergences else None,
            "min_first_divergence": min(divergences) if divergences else None,
        }
