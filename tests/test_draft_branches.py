"""Mismatch prediction and every branch reuse rule, on hand-built tensors."""

import torch

from recguide_hf.core import branches as br
from recguide_hf.core.draft import DraftBlock, make_draft, risky_positions
from recguide_hf.core.masks import causal_intra
from recguide_hf.core.verify import Verdict

MASK, EOS = 3, 1


def logits_with(top: list[tuple[int, float, int, float]], vocab=12):
    """[1, K, V] logits where position k has token a at logit x and token b at logit y."""
    out = torch.full((1, len(top), vocab), -20.0)
    for k, (a, x, b, y) in enumerate(top):
        out[0, k, a], out[0, k, b] = x, y
    return out


def test_margin_excludes_mask_and_correction_rules():
    # position 0: MASK has the top logit but is excluded -> drafted 5, runner-up 6 nearly tied: risky
    lg = logits_with([(5, 2.0, 6, 1.99), (7, 9.0, 8, 0.0), (9, 1.0, EOS, 1.0)])
    lg[0, 0, MASK] = 50.0
    d = make_draft(lg, MASK, [EOS])
    assert d.ids.tolist() == [[5, 7, 9]] or d.ids.tolist() == [[5, 7, EOS]]
    assert d.correction[0, 0] == 6  # second-ranked
    assert d.correction[0, 2] not in (EOS, MASK, int(d.ids[0, 2]))  # never EOS, MASK or the draft itself
    risky = risky_positions(d, torch.tensor([3]), delta=0.5, max_corrections=2)
    assert risky.positions.tolist() == [[1, 3]]  # 1-based d_p; position 2 is confident
    assert risky.num_risky.tolist() == [2]


def test_keeps_earliest_two_of_three_risky():
    d = DraftBlock(ids=torch.tensor([[4, 5, 6, 7]]), margin=torch.tensor([[0.9, 0.1, 0.2, 0.3]]),
                   correction=torch.tensor([[8, 9, 10, 11]]))
    r = risky_positions(d, torch.tensor([4]), delta=0.5, max_corrections=2)
    assert r.positions.tolist() == [[2, 3]] and r.corrections.tolist() == [[9, 10]]
    assert r.num_risky.tolist() == [3]
    plan = br.plan(r, torch.tensor([5]), 4, True, MASK)
    assert sorted(plan.kind[0].tolist()) == [0, 1]  # 3 risky: no continuation branch
    r1 = risky_positions(d, torch.tensor([4]), delta=0.5, max_corrections=1)
    assert r1.positions.tolist() == [[2]]


def _plan_one(positions, corrections, num_risky, eff=5, block=4, continuation=True):
    from recguide_hf.core.draft import RiskyPositions

    r = RiskyPositions(torch.tensor([positions]), torch.tensor([corrections]), torch.tensor([num_risky]))
    return br.plan(r, torch.tensor([eff]), block, continuation, MASK)


def _reuse(plan, n_acc, token, bonus_guess=None, draft_len=4, vocab=16):
    s, b = plan.kind.shape[1], plan.block
    logits = torch.zeros(1, s * b, vocab)
    logits[0, :, 4] = 1.0  # every drafted branch token: 4
    if bonus_guess is not None:
        for j in range(s):
            if plan.kind[0, j] == br.CONTINUATION:
                logits[0, j * b, bonus_guess] = 5.0
    verdict = Verdict(torch.tensor([n_acc]), torch.tensor([token]))
    return br.reuse(plan, verdict, torch.tensor([draft_len]), logits, MASK, [EOS], None)


def test_correction_hit_at_p():
    plan = _plan_one([2, -1], [9, -1], 1)
    hits = _reuse(plan, n_acc=1, token=9)  # first mismatch at d_2, verifier says 9 == c_2
    assert hits.kind.tolist() == [br.CORRECTION_1]
    assert hits.block.ids.tolist() == [[4, 4, 4]]


def test_correction_miss_cases():
    plan = _plan_one([2, -1], [9, -1], 1)
    assert _reuse(plan, n_acc=0, token=9).kind.tolist() == [-1]  # mismatch before p
    assert _reuse(plan, n_acc=2, token=9).kind.tolist() == [-1]  # mismatch after p
    assert _reuse(plan, n_acc=1, token=8).kind.tolist() == [-1]  # right position, wrong token


def test_second_correction_hit():
    plan = _plan_one([1, 3], [7, 9], 2)
    assert _reuse(plan, n_acc=2, token=9).kind.tolist() == [br.CORRECTION_2]
    assert _reuse(plan, n_acc=0, token=7).kind.tolist() == [br.CORRECTION_1]


def test_continuation_rules():
    plan = _plan_one([-1, -1], [-1, -1], 0)
    assert plan.kind.tolist() == [[br.CONTINUATION]]
    assert _reuse(plan, n_acc=4, token=11, bonus_guess=11).kind.tolist() == [br.CONTINUATION]
    assert _reuse(plan, n_acc=4, token=12, bonus_guess=11).kind.tolist() == [-1]  # bonus differs
    assert _reuse(plan, n_acc=3, token=11, bonus_guess=11).kind.tolist() == [-1]  # not fully accepted
    off = _plan_one([-1, -1], [-1, -1], 0, continuation=False)
    assert off.kind.shape[1] == 0


def test_segment_mask_matches_brute_force():
    # one row, verifier segment of 5 (seed + 4 drafts), correction at p=2 and a continuation, block 4
    plan = _plan_one([2, -1], [9, -1], 1, eff=5, block=4)
    q = 5
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    offsets = torch.arange(q)[None]
    intra = causal_intra(1, q)
    ids2, off2, intra2 = br.append_segments(plan, ids, offsets, intra)
    segments = [(int(plan.kind[0, j]), int(plan.prefix[0, j])) for j in range(2)]
    total = q + 2 * 4
    expect = torch.zeros(total, total, dtype=torch.bool)
    expect[:q, :q] = torch.ones(q, q, dtype=torch.bool).tril()
    for j, (_, prefix) in enumerate(segments):
        lo = q + j * 4
        for a in range(lo, lo + 4):
            for c in range(prefix):
                expect[a, c] = True
            for c in range(lo, lo + 4):
                expect[a, c] = True
    assert torch.equal(intra2[0], expect)
    kinds = plan.kind[0].tolist()
    corr = q + 4 * kinds.index(br.CORRECTION_1)
    cont = q + 4 * kinds.index(br.CONTINUATION)
    assert ids2[0, corr:corr + 4].tolist() == [9, MASK, MASK, MASK]
    assert off2[0, corr:corr + 4].tolist() == [2, 3, 4, 5]  # c_2 sits where d_2 was
    assert ids2[0, cont:cont + 4].tolist() == [MASK] * 4
    assert off2[0, cont:cont + 4].tolist() == [5, 6, 7, 8]
