"""Training-data helpers of eval/: draft blocks (the drafter's objective) and the teacher's loop cut."""


import pytest
import torch
from measure_model import distinct4
from teacher_data import loop_start
from train import draft_blocks

from recguide_hf import BUNDLED_MODEL

MASK = 3


def _check_blocks(x, b, k, lo, valid):
    gen = torch.Generator().manual_seed(0)
    ids, pos, labels, weights, allowed = draft_blocks(x, b, k, MASK, gen, lo=lo, valid=valid)
    n, length = x.shape
    assert ids.shape == pos.shape == labels.shape == weights.shape == (n, k * b)
    assert allowed.shape == (n, 1, k * b, length + k * b)
    for r in range(n):
        limit = length if valid is None else int(valid[r])
        for j in range(k):
            sl = slice(j * b, (j + 1) * b)
            p = pos[r, sl]
            start = int(p[0])
            assert lo <= start and torch.equal(p, torch.arange(start, start + b))
            # seed kept at offset 0 unless the block is continuation-shaped; every other input is MASK
            assert (ids[r, sl][1:] == MASK).all()
            assert int(ids[r, sl][0]) in (MASK, int(x[r, start]))
            for i in range(b):
                trained = int(labels[r, j * b + i]) != -100
                masked_in = int(ids[r, j * b + i]) == MASK
                # a position is trained iff it is a MASK input whose target lies inside the valid span
                assert trained == (masked_in and int(p[i]) < limit)
                if trained:
                    assert int(labels[r, j * b + i]) == int(x[r, p[i]])
                    assert weights[r, j * b + i] > 0
                else:
                    assert weights[r, j * b + i] == 0
            # attention: clean prefix strictly before the block start, and its own block only
            rows = allowed[r, 0, sl]
            assert rows[:, :start].all() and not rows[:, start:length].any()
            own = torch.zeros(k * b, dtype=torch.bool)
            own[sl] = True
            assert torch.equal(rows[:, length:], own.expand(b, -1))


def test_draft_blocks_plain_sequences():
    x = torch.randint(10, 100, (3, 64))
    _check_blocks(x, 8, 4, 1, None)


def test_draft_blocks_inside_teacher_continuations():
    x = torch.randint(10, 100, (4, 96))
    valid = torch.tensor([40, 50, 96, 34])
    _check_blocks(x, 16, 5, 32, valid)


def test_loop_cut_and_distinct_ratio():
    text = list(range(20)) + [7, 8, 9, 10, 11, 12, 13, 14, 50]  # 7..14 (an 8-gram) repeats at index 20
    assert loop_start(text) == 20
    assert loop_start(list(range(30))) == 30
    assert distinct4([1, 2, 3, 4] * 5) == 4 / 17
    assert distinct4(list(range(10))) == 1.0


def test_docstring_ends_mark_humaneval_shaped_window_ends():
    """Window ends fall right after a function's docstring closes (and its newline), never after the
    opening quotes, and never for a docstring-less def."""
    import numpy as np
    from teacher_data import docstring_ends
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL)
    q = '"' * 3
    text = (f"import os\n\n\ndef add(a, b):\n    {q}Add two numbers.\n\n    More words here.\n    {q}\n"
            "    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            f"def mul(a, b):\n    {q}Multiply.{q}\n    return a * b\n")
    arr = np.array(tok(text)["input_ids"])
    ends = docstring_ends(arr, tok, prompt_len=1)
    prompts = [tok.decode(arr[:e]) for e in ends]
    assert len(prompts) == 2
    assert prompts[0].rstrip(" ").endswith(f"More words here.\n    {q}\n")
    assert prompts[1].rstrip(" ").endswith(f"{q}Multiply.{q}\n")


def test_distill_seed_layout_matches_the_engine():
    """`training/distill.py --first-draft verifier`: a block's seed sees the clean prefix and itself with the base
    weights (so its logits are the verifier's own next-token logits, d_1), its masks draft with the adapter
    and see the whole block; the loss starts at place 2 there. The default layout keeps every token drafting."""
    from argparse import Namespace

    from conftest import tiny_model
    from distill import AdapterStudent, decay_weights
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(4, 96, (2, 40), generator=gen)
    base = tiny_model(0)
    with torch.no_grad():
        plain = base(input_ids=x).logits  # the verifier's causal logits
    args = Namespace(init=None, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"], first_draft="verifier")
    student = AdapterStudent(tiny_model(0), args)
    with torch.no_grad():
        for b in student.adapter.lora_B:
            b.normal_(0, 0.5)  # a trained adapter: not the identity
    for first_draft in ("verifier", "mask"):
        student.first_draft = first_draft
        cache = DynamicCache(config=student.model.config)
        with torch.no_grad():
            student.model(input_ids=x, cache=cache, use_cache=True)
            logits, pos, ok, block_pos, seeded = student.block_logits(cache, x, torch.full((2,), 40), 8, 8, 3,
                                                                      torch.Generator().manual_seed(1))
        seed = (block_pos == 0) & seeded  # block tokens that are a clean seed
        assert seed.sum() >= 3
        rows, cols = seed.nonzero(as_tuple=True)
        from_base = plain[rows, pos[rows, cols]]  # the verifier's logits at the seed's own position
        close = torch.allclose(logits[rows, cols], from_base, atol=1e-4)
        assert close == (first_draft == "verifier")
    w = decay_weights(torch.arange(5), 4.0, first=2)
    assert w[:2].tolist() == [0.0, 0.0] and w[2] == 1.0 and w[3] == pytest.approx(torch.exp(torch.tensor(-0.25)).item())


def test_teacher_batches_pool_several_files(tmp_path):
    """`distill.py --teacher-data a.npz b.npz`: rows of both files are drawn; files of another shape are refused."""
    import numpy as np
    from train import TeacherBatches

    def write(name, fill, rows, prompt_len=4, width=10):
        path = tmp_path / name
        np.savez(path, tokens=np.full((rows, width), fill, dtype=np.int32),
                 valid=np.full((rows,), width, dtype=np.int32), prompt_len=prompt_len)
        return path

    a, b = write("a.npz", 1, 3), write("b.npz", 2, 5)
    batches = TeacherBatches([a, b], batch_size=64, seed=0)
    assert batches.tokens.shape == (8, 10) and batches.prompt_len == 4
    tokens, valid = batches.next()
    assert set(tokens[:, 0].tolist()) == {1, 2} and torch.equal(valid, torch.full((64,), 10))
    assert torch.equal(TeacherBatches(a, 4, 0).tokens, torch.ones(3, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="differ"):
        TeacherBatches([a, write("c.npz", 3, 2, prompt_len=5)], 4, 0)


def test_correction_hits_follow_the_reuse_rule():
    """Known answers for `training/distill.py`'s offline correction coverage (docs/algorithm.md §2.2): the first
    mismatch must be one of the two earliest risky places and its correction token must be the verifier's."""
    from distill import correction_hits

    #            place:   0    1    2    3
    margin = torch.tensor([[0.9, 0.2, 0.3, 0.1],   # mismatch at 2: risky, one risky place before it -> kept
                           [0.1, 0.2, 0.3, 0.9],   # mismatch at 2: risky, but two risky places before it
                           [0.9, 0.9, 0.9, 0.9],   # mismatch at 1: not risky
                           [0.1, 0.1, 0.1, 0.1],   # mismatch at 0, but the correction is not the verifier's
                           [0.1, 0.1, 0.1, 0.1]])  # whole block accepted: nothing to correct
    targets = torch.full((5, 4), 7)
    correction = torch.full((5, 4), 7)
    correction[3, 0] = 8
    runs = torch.tensor([2, 2, 1, 0, 4])
    hits = correction_hits(margin[:, None], correction[:, None], targets[:, None], runs[:, None])
    assert hits.squeeze(1).tolist() == [True, False, False, False, False]


def test_rank2_term_trains_the_correction_token_and_leaves_a_right_argmax_alone():
    """`--rank2-weight`: where the student's argmax is wrong, the teacher's token is pushed towards second place
    without touching the argmax's logit; where the argmax is right, the term adds nothing."""
    from distill import distill_loss

    teacher = torch.log_softmax(torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0], [0.0, 5.0, 1.0, 0.0, 0.0]]), -1)
    student = torch.tensor([[0.0, 0.0, 3.0, 1.0, 2.0],   # argmax 2, teacher's token 1: wrong
                            [0.0, 4.0, 3.0, 1.0, 2.0]])  # argmax 1: right
    ok, w = torch.ones(2), torch.ones(2)
    grads = {}
    for rank2 in (0.0, 1.0):
        s = student.clone().requires_grad_(True)
        loss, _ = distill_loss(s * 1, teacher, ok, w, 0.0, mask_id=0, rank2_weight=rank2, excluded=[4])  # not a leaf
        loss.backward()
        grads[rank2] = s.grad
    extra = grads[1.0] - grads[0.0]
    assert extra[0, 2] == 0 and extra[0, 1] < 0  # argmax untouched; the teacher's token raised
    assert extra[0, 4] == 0  # an excluded token (EOS) is no candidate
    assert torch.equal(extra[1], torch.zeros(5))  # a right argmax: no rank-2 term


def test_average_adapters_is_the_mean_of_a_and_b_and_records_it(tmp_path):
    import json

    from average_adapters import average
    from safetensors.torch import load_file, save_file

    folders = []
    for i in range(2):
        f = tmp_path / f"a{i}"
        f.mkdir()
        save_file({"x.lora_A.weight": torch.full((2, 3), float(i)), "x.lora_B.weight": torch.full((3, 2), 2.0 * i)},
                  f / "adapter_model.safetensors")
        (f / "adapter_config.json").write_text("{}")
        (f / "distill_log.json").write_text(json.dumps({"log": [{"minutes": 10.0 * (i + 1)}]}))
        folders.append(f)
    record = average(folders, tmp_path / "out")
    w = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert torch.equal(w["x.lora_A.weight"], torch.full((2, 3), 0.5))
    assert torch.equal(w["x.lora_B.weight"], torch.full((3, 2), 1.0))
    log = json.loads((tmp_path / "out" / "distill_log.json").read_text())
    assert log["averaged_from"] == record and record["minutes"] == [10.0, 20.0]
    save_file({"x.lora_A.weight": torch.zeros(4, 3), "x.lora_B.weight": torch.zeros(3, 4)},
              folders[1] / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="shapes"):
        average(folders, tmp_path / "out2")


def test_confidence_weights_by_hand():
    """D-PACE's weights: w_k = sum_{m>=k} prod_{j<=m} (0.5 + 0.5 q_j); untrained places count as certain."""
    from recguide_hf.tools.distill.loop import confidence_weights

    q = torch.tensor([[0.0, 1.0, 0.0, 0.5]])  # one block of 4 places; place 0 (a seed) not trained
    trained = torch.tensor([[False, True, True, True]])
    w = confidence_weights(q, trained, 4)
    # reach: 1 (seed), 1, 0.5, 0.375; w_k = sum of reach from k on
    assert w.tolist() == [[0.0, 1.875, 0.875, 0.375]]
