"""The user's stopping criteria, evaluated per emitted token although rounds emit several at once.

HF criteria take the whole batch `input_ids [N, T]`; in HF's loop every row has the same number of new
tokens, laid out `[left-padded prompt (W) | k new tokens]`, and lm-eval's criteria rely on that: they are
stateful per row and read each row's tokens after column W (`input_ids[:, W:]`, last few). In a round rows
advance by different amounts, so the engine replays the new tokens step by step, and each call shows a group
of rows with the SAME number of new tokens s exactly as HF would (`[prompt | s tokens]`, width W + s). Every
other row is shown `[prompt | the first min(m, s) of the m tokens it was already judged on | pad]`: a view it
was judged on before, or one ending in padding, so a stateful criterion learns nothing new about it, and no
prompt text slides into the window after W. Only the group's results are used. A criterion that returns one
bool for the batch ends the whole batch, as it ends HF's loop, each row after the last token the criteria
were shown of it. lm-eval's criterion returns such a bool (True once its per-row tracker has seen every row's
stop sequence) and keeps the tracker as `done_tracker`: a row it counts as done stops at that token. In HF's
lockstep loop a done row waits, generating, for the slowest; here rows advance at their own pace, and a done
row that generated on would burn forwards until the slowest row got done (it once ran every fast row to
max_new_tokens: speculation slower than `generate` on lm-eval's next-line tasks). A row then ends shortly after
its stop sequence while HF's row runs on to the batch's common length; the tokens before the stop, all that
lm-eval keeps, are the same. EOS and max_new_tokens are handled by the engine itself; HF's MaxLength/EOS
criteria are dropped here.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..core.hooks import NoStopping


class StopChecker(NoStopping):
    def __init__(self, criteria, pad_token_id: int):
        self.criteria = [c for c in (criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.pad_token_id = pad_token_id

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
                whole_batch = False
                for crit in self.criteria:
                    res = crit(ids, None)
                    if torch.is_tensor(res) and res.numel() == seq.shape[0]:
                        done |= res.to(seq.device).bool()
                    else:
                        whole_batch |= bool(res)
                        rows_done = _row_tracker(crit, seq.shape[0])
                        if rows_done is not None:
                            done |= rows_done.to(seq.device)
                seen[group] = s
                if whole_batch:  # one bool for the batch ends HF's whole loop: every row ends where it is
                    self._cut(seq, count, count > seen, seen)  # after the last token it was judged on
                    finished[:] = True
                    self.ended = True
                    return
                stop = done & group
                self._cut(seq, count, stop, torch.full_like(count, s))
                finished |= stop

    def _cut(self, seq: torch.Tensor, count: torch.Tensor, rows: torch.Tensor, new_count: torch.Tensor):
        """Rows `rows` [N] bool end after `new_count` [N] new tokens: the tokens past it become padding."""
        w = self.prompt_width
        for r in rows.nonzero().squeeze(1).tolist():
            seq[r, w + int(new_count[r]):w + int(count[r])] = self.pad_token_id
        count[rows] = new_count[rows]


def _row_tracker(criterion, num_rows: int) -> torch.Tensor | None:
    """[N] bool: the rows a batch-level criterion already counts as done, where it keeps that per row
    (lm-eval's MultiTokenEOSCriteria: `done_tracker`, True once a row's window held the stop sequence); else None."""
    tracker = getattr(criterion, "done_tracker", None)
    if isinstance(tracker, list) and len(tracker) == num_rows and all(isinstance(t, bool) for t in tracker):
        return torch.tensor(tracker)
    return None
