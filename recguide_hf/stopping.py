"""The user's stopping criteria, evaluated per emitted token although rounds emit several at once.

HF criteria take the whole batch `input_ids [N, T]` (lm-eval's are stateful and sized to the batch), so
after a round the engine replays the new tokens step by step: at step k each row shows its sequence up to
its own k-th new token (right-aligned, left-padded with pad), and a row that a criterion marks done
stops at that token, just as HF's loop would have stopped it. EOS and max_new_tokens are handled by the
engine itself; HF's MaxLength/EOS criteria are dropped here.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


class StopChecker:
    def __init__(self, criteria, pad_token_id: int):
        self.criteria = [c for c in (criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.pad_token_id = pad_token_id

    def start(self, seq: torch.Tensor, prompt_width: int):
        self.prompt_width = prompt_width

    def check(self, seq: torch.Tensor, count: torch.Tensor, finished: torch.Tensor, old_counts):
        """Mark rows done (`finished`, in place) and truncate `count` at the token that stopped them."""
        if not self.criteria:
            return
        rows, old = old_counts
        before = count.clone()
        before[rows] = old
        steps = int((count - before).max())
        for k in range(1, steps + 1):
            shown = torch.minimum(before + k, count)  # [N] tokens of each row shown at step k
            live = ~finished | (shown > before)  # rows finished this round still replay their tokens
            width = self.prompt_width + int(shown.max())
            ids = torch.full((seq.shape[0], width), self.pad_token_id, dtype=seq.dtype, device=seq.device)
            for r in range(seq.shape[0]):
                n = self.prompt_width + int(shown[r])
                ids[r, width - n:] = seq[r, :n]
            done = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
            for crit in self.criteria:
                res = crit(ids, None)
                done |= res.to(seq.device).bool() if torch.is_tensor(res) else torch.full_like(done, bool(res))
            stop = done & live & (shown > before) & (shown <= count)
            if bool(stop.any()):
                for r in stop.nonzero().squeeze(1).tolist():
                    seq[r, self.prompt_width + int(shown[r]):self.prompt_width + int(count[r])] = self.pad_token_id
                count[stop] = shown[stop]
                finished |= stop
            if bool(finished.all()):
                return
