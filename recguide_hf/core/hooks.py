"""What the engine asks of a caller once per round: the scores tokens are chosen from, and whether rows stop.

The defaults here are the engine's own behaviour with no user settings: verifier logits with MASK removed (so
MASK is never emitted), and no stopping rule beyond EOS and max_new_tokens (which the engine handles itself).
The integrations subclass them for the user's HF logits processors (`integrations/processors.py`) and stopping
criteria (`integrations/stopping.py`).
"""

from __future__ import annotations

import torch


class VerifierScores:
    """Raw verifier logits `[R, Q, V]` -> the scores a row's tokens are chosen from."""

    def __init__(self, mask_token_id: int):
        self.mask_token_id = mask_token_id

    def __call__(self, seq: torch.Tensor, prompt_width: int, counts: torch.Tensor, rows: torch.Tensor,
                 block_ids: torch.Tensor, logits: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
        """
        Args:
            seq: [N, W + max_new] all requests' token buffer (prompt, then emitted tokens incl. the seed).
            counts: [R] emitted tokens of the rows; rows: [R] their indices in seq.
            block_ids: [R, >=Q] the verified block `[seed, d_1 ..]`; logits: [R, Q, V]; eff: [R] real length.
        """
        scores = logits.float()
        scores[..., self.mask_token_id] = float("-inf")
        return scores


class NoStopping:
    """Rows end only by EOS or their max_new_tokens. `ended`: a rule ended every row at once."""

    ended = False

    def start(self, seq: torch.Tensor, prompt_width: int):
        self.prompt_width = prompt_width
        self.ended = False

    def check(self, seq: torch.Tensor, count: torch.Tensor, finished: torch.Tensor, old_counts):
        """Mark rows done (`finished`, in place) and truncate `count` at the token that stopped them."""
