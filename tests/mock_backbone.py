"""A deterministic stand-in backbone whose acceptance pattern is known in advance.

The "true text" is a fixed token per position: the verifier at position t always predicts T[t+1]; a
MASK at position t drafts D[t], and when D[t] is wrong its runner-up is the right token T[t] with a tiny
margin (so the position is risky and its correction is right). Rounds, hits and forwards can then be
worked out by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from recguide_hf.models.hf_backbone import HFBackbone as Backbone

MASK = 3
EOS = 1


class MockBackbone(Backbone):
    def __init__(self, true_tokens: list[int], draft_tokens: list[int], vocab: int = 64):
        self.true = torch.tensor(true_tokens)
        self.drafts = torch.tensor(draft_tokens)
        self.vocab = vocab
        self.mask_token_id = MASK
        module = torch.nn.Linear(1, 1)
        module.config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2, hidden_size=2,
                                        num_attention_heads=1, vocab_size=vocab, max_position_embeddings=4096)
        self.model = module
        self.calls = []  # (num_rows, query_len, num_draft_tokens) per forward

    def forward(self, input_ids, position_ids, attention_mask, cache, draft_mask=None, logits_to_keep=0):
        num_rows, q = input_ids.shape
        if isinstance(draft_mask, int):  # columns draft_mask.. of every row (0: a draft forward; k: branch segments)
            num_draft = num_rows * (q - draft_mask)
        else:
            num_draft = int(draft_mask.sum()) if draft_mask is not None else 0
        self.calls.append((num_rows, q, num_draft))
        logits = torch.zeros(num_rows, q, self.vocab)
        is_mask = input_ids == MASK
        nxt = self.true[(position_ids + 1).clamp(max=len(self.true) - 1)]
        here_true = self.true[position_ids.clamp(max=len(self.true) - 1)]
        here_draft = self.drafts[position_ids.clamp(max=len(self.drafts) - 1)]
        top1 = torch.where(is_mask, here_draft, nxt)
        logits.scatter_(2, top1[..., None], 10.0)
        wrong = is_mask & (here_draft != here_true)
        second = torch.where(wrong, here_true, torch.full_like(here_true, 0))
        runner = torch.where(wrong, torch.full_like(top1, 9.99, dtype=torch.float), torch.full_like(top1, 0.0,
                             dtype=torch.float))
        logits.scatter_(2, second[..., None], runner[..., None])
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return logits
