"""Accept / reject rules on hand-built tensors, and the sampling distribution."""

import torch

from recguide_hf.core.verify import greedy_verify, sampling_verify


def test_greedy_accepts_matching_prefix_only():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [9, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])  # a_0..a_3
    v = greedy_verify(draft, target, torch.tensor([3, 3, 3]))
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.next_token.tolist() == [8, 6, 5]  # bonus, recovered, recovered


def test_greedy_respects_draft_len():
    draft = torch.tensor([[5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8]])
    v = greedy_verify(draft, target, torch.tensor([1]))
    assert v.num_accepted.tolist() == [1]
    assert v.next_token.tolist() == [6]  # the verifier's token after d_1


def test_sampling_keeps_target_distribution():
    torch.manual_seed(0)
    vocab, n = 6, 60000
    target = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.1, 0.05])
    draft = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    draft_ids = torch.multinomial(draft, n, replacement=True)[:, None]  # [n, 1]
    draft_probs = draft.expand(n, 1, vocab)
    target_probs = target.expand(n, 2, vocab)
    v = sampling_verify(draft_ids, draft_probs, target_probs, torch.ones(n, dtype=torch.long))
    first = torch.where(v.num_accepted == 1, draft_ids[:, 0], v.next_token)
    empirical = torch.bincount(first, minlength=vocab).float() / n
    tv = 0.5 * (empirical - target).abs().sum()
    assert tv < 0.015, tv
    # the check can fail: the draft distribution itself is far from the target
    assert 0.5 * (draft - target).abs().sum() > 0.3


def test_sampling_accepts_identical_distributions():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(4, 3, 10), -1)
    ids = torch.multinomial(probs[:, :2].reshape(-1, 10), 1).view(4, 2)
    v = sampling_verify(ids, probs[:, :2], probs, torch.full((4,), 2))
    assert v.num_accepted.tolist() == [2, 2, 2, 2]
