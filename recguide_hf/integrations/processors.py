"""The user's logits processors, applied to verifier logits per position with the matching prefix.

HF generation calls each processor once per generated position with `input_ids` = everything before
that position. A verify forward scores a whole block at once, so position i of a row's block is
processed with `[that row's sequence so far, d_1 .. d_i]`, exactly what HF would have passed. Processors
that never read `input_ids` (temperature, top-k, top-p, suppress-tokens...) run once over all positions.
The MASK token is always removed from verifier scores, so it is never emitted.
"""

from __future__ import annotations

import torch
from transformers import generation as hf_gen

from ..core.hooks import VerifierScores

_INPUT_FREE = tuple(getattr(hf_gen, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "SuppressTokensLogitsProcessor",
) if hasattr(hf_gen, name))


class ScoreProcessor(VerifierScores):
    """Turns raw verifier logits `[R, Q, V]` into the scores HF's loop would have sampled from."""

    def __init__(self, processors, mask_token_id: int):
        super().__init__(mask_token_id)
        self.processors = list(processors or [])
        self.input_free = all(isinstance(p, _INPUT_FREE) for p in self.processors)

    def __call__(self, seq, prompt_width, counts, rows, block_ids, logits, eff):
        """Arguments as `VerifierScores.__call__`."""
        scores = super().__call__(seq, prompt_width, counts, rows, block_ids, logits, eff)
        if not self.processors:
            return scores
        num_rows, q, vocab = scores.shape
        if self.input_free:
            flat = scores.reshape(num_rows * q, vocab)
            dummy = torch.zeros(num_rows * q, 1, dtype=torch.long, device=scores.device)
            for proc in self.processors:
                flat = proc(dummy, flat)
            return flat.view(num_rows, q, vocab)
        # HF processors may hold per-row state indexed by the batch (e.g. repetition penalty's padding
        # lengths), so they always see the full batch [N, L]; one call per distinct prefix length L.
        out = scores.clone()
        n = seq.shape[0]
        wanted: dict[int, list[tuple[int, int]]] = {}
        for r in range(num_rows):
            for i in range(int(eff[r])):
                wanted.setdefault(prompt_width + int(counts[r]) + i, []).append((r, i))
        for length, members in sorted(wanted.items()):
            ids = seq[:, :length].clone() if length <= seq.shape[1] else torch.nn.functional.pad(
                seq, (0, length - seq.shape[1]))
            batch_scores = torch.zeros(n, vocab, device=scores.device)
            for r, i in members:
                g = int(rows[r])
                start = prompt_width + int(counts[r])
                ids[g, start:length] = block_ids[r, 1 : i + 1]
                batch_scores[g] = scores[r, i]
            for proc in self.processors:
                batch_scores = proc(ids, batch_scores)
            for r, i in members:
                out[r, i] = batch_scores[int(rows[r])]
        return out
