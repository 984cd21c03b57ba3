"""The user's stopping criteria, evaluated per emitted token although rounds emit several at once.

HF criteria take the whole batch `input_ids [N, T]`; in HF's loop every row has the same number of new
tokens, laid out `[left-padded prompt (W) | k new tokens]`, and lm-eval's criteria rely on that: they are
stateful per row and read each row's tokens after column W (`input_ids[:, W:]`, last few). In a round rows
advance by different amounts, so the engine replays the new tokens step by step, and each call shows a group
of rows with the SAME number of new tokens s exactly as HF would (`[prompt | s tokens]`, width W + s). Every
other row is shown `[prompt | the first min(m, s) of the m tokens it was already judged on | pad]`: a view it
was judged on before, or one ending in padding, so a stateful criterion learns nothing new about it, and no
prompt text slides into the window after W. Only the group's results are used. A criterion that returns one
bool for the batch (lm-eval's "all rows done") stops the group's rows at that token. EOS and max_new_tokens
are handled by the engine itself; HF's MaxLength/EOS criteria are dropped here.
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
        seen = before.clone()  # new tokens of each row the criteria have been shown so far
        w = self.prompt_width
        cols = torch.arange(int(count.max()), device=seq.device)
        for k in range(1, int((count - before).max()) + 1):
            moving = before + k <= count  # rows with a k-th new token this round (not cut before it)
            for s in (before + k)[moving].unique().tolist():
                group = moving & (before + k == s)
                ids = torch.full((seq.shape[0], w + s), self.pad_token_id, dtype=seq.dtype, device=seq.device)
                ids[:, :w] = seq[:, :w]
                shown = torch.where(group, torch.full_like(seen, s), torch.minimum(seen, torch.full_like(seen, s)))
                keep = cols[None, :s] < shown[:, None]
                ids[:, w:] = torch.where(keep, seq[:, w:w + s], ids[:, w:])
                done = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
                for crit in self.criteria:
                    res = crit(ids, None)
                    done |= res.to(seq.device).bool() if torch.is_tensor(res) else torch.full_like(done, bool(res))
                seen[group] = s
                stop = done & group
                for r in stop.nonzero().squeeze(1).tolist():
                    seq[r, w + s:w + int(count[r])] = self.pad_token_id
                count[stop] = s
                finished |= stop
