"""Engine: parity with plain HF greedy, stopping, statistics on hand-worked cases, sampling."""

import time

import pytest
import torch
from conftest import EOS, MASK, PAD, left_pad, random_prompts, tiny_model
from mock_backbone import MockBackbone
from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor, StoppingCriteria, StoppingCriteriaList

import recguide_hf
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.core.policy import BlockPolicy
from recguide_hf.integrations.processors import ScoreProcessor
from recguide_hf.integrations.stopping import StopChecker
from recguide_hf.models.registry import as_backbone


def hf_greedy(model, ids, mask, **kw):
    if mask is not None:  # transformers 5.0's generate fails on an explicit attention_mask=None
        kw["attention_mask"] = mask
    return model.generate(ids, do_sample=False, **kw)


def hf_alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One prompt's new tokens from plain HF greedy at batch 1, its padding (id 2) after EOS stripped."""
    ref = hf_greedy(model, torch.tensor([prompt]), None, max_new_tokens=max_new_tokens)[0, len(prompt):].tolist()
    while ref and ref[-1] == 2 and EOS in ref:
        ref.pop()
    return ref


@pytest.mark.parametrize("mode", ["linear", "recguide"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_parity_batches_and_blocks(model, mode, batch):
    prompts = random_prompts(batch, 96, min_len=1, max_len=20, seed=batch)
    ids, mask = left_pad(prompts)
    ref = hf_greedy(model, ids, mask, max_new_tokens=23)
    for block in (1, 2, 3, 8, 16, 32):  # B = 1: plain decoding steps inside the engine
        out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=23, recguide_mode=mode,
                                   recguide_block_size=block)
        assert torch.equal(out, ref), (mode, block)


class Alternate(BlockPolicy):
    """Each slot switches between a plain step (B = 1) and B = 8 from round to round, neighbours out of step."""

    def start(self, num_rows):
        super().start(num_rows)
        self.turns = torch.zeros(num_rows, dtype=torch.long)  # rounds planned per slot

    def plan(self, rows, pending_has, remaining=None):
        self.turns[rows.cpu()] += 1
        return torch.where((rows + self.turns[rows.cpu()].to(rows.device)) % 2 == 1, 1, 8)


def test_the_timing_seam_books_every_phase_and_changes_no_token(model):
    """`Engine(phases=PhaseClock())` books the engine clock's seconds per phase path: the admission with its
    prefill forwards, the plan, each speculative round's phases with their forwards apart (`verify/forward`), a
    plain step's; the paths' seconds add up to no more than the call's, and the tokens are the untimed engine's."""
    from recguide_hf.core.phases import PhaseClock

    ids, mask = left_pad(random_prompts(3, 96, min_len=2, max_len=9, seed=2))
    cfg = DecodingConfig(mode="recguide", block_size=8)
    settings = SamplingSettings(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=PAD)
    plain, _ = Engine(as_backbone(model), cfg, settings, policy=Alternate(cfg)).generate(ids, mask)
    clock = PhaseClock()
    t0 = time.perf_counter()
    out, stats = Engine(as_backbone(model), cfg, settings, policy=Alternate(cfg), phases=clock).generate(ids, mask)
    wall = time.perf_counter() - t0
    assert torch.equal(out, plain)
    for path in ("admit", "admit/forward", "plan", "draft", "draft/forward", "verify", "verify/forward", "process",
                 "accept", "commit", "reuse", "record", "observe", "plain", "plain/forward"):
        assert clock.calls[path] > 0 and clock.seconds[path] >= 0, path
    assert clock.calls["plan"] == int(stats.rounds.max())  # once per step of the whole batch
    assert 0 < clock.total() <= wall
    assert clock.total("admit") == clock.seconds["admit"] + clock.seconds["admit/forward"]
    folded = clock.by_phase(outside=("admit",))
    assert "admit" not in folded and folded["forward"] == pytest.approx(
        sum(s for p, s in clock.seconds.items() if p.endswith("/forward") and not p.startswith("admit")))


def test_parity_plain_steps_mixed_with_speculation(model):
    """Requests switching between plain steps (B = 1) and B = 8 from round to round, in separate buckets."""

    prompts = random_prompts(5, 96, min_len=1, max_len=20, seed=11)
    ids, mask = left_pad(prompts)
    ref = hf_greedy(model, ids, mask, max_new_tokens=29)
    cfg = DecodingConfig(mode="linear", block_size=8)
    settings = SamplingSettings(max_new_tokens=29, eos_token_ids=[EOS], pad_token_id=PAD)
    engine = Engine(as_backbone(model), cfg, settings, policy=Alternate(cfg))
    out, stats = engine.generate(ids, mask)
    assert torch.equal(out, ref[:, :out.shape[1]]) and out.shape == ref.shape
    assert set(stats.as_dict()["block_sizes"]) == {1, 8}


def test_plain_round_equals_the_general_round_at_one(model):
    """`_plain_round` (the lean B = 1 path) against `_round(rows, 1)` (the general path, where the draft is
    empty): the same sequences and statistics, greedy with EOS, processors and a stopping criterion, and
    sampled with one seed."""
    ids, mask = left_pad(random_prompts(4, 96, min_len=2, max_len=11, seed=21))
    free = hf_greedy(model, ids, mask, max_new_tokens=16)
    stop = StoppingCriteriaList([StopAfterToken(int(free[1, ids.shape[1] + 3]))])
    eos = int(free[2, ids.shape[1] + 5])  # a token row 2 emits, as EOS
    cases = [(False, [EOS, eos], stop), (True, [EOS], None)]
    for do_sample, eos_ids, criteria in cases:
        outs = []
        for lean in (True, False):
            settings = SamplingSettings(max_new_tokens=16, eos_token_ids=eos_ids, pad_token_id=PAD,
                                        do_sample=do_sample)
            cfg = DecodingConfig(mode="linear", block_size=1)
            processor = ScoreProcessor([RepetitionPenaltyLogitsProcessor(1.4)], MASK)
            engine = Engine(as_backbone(model), cfg, settings, processor=processor,
                            stopper=StopChecker(criteria or [], PAD))
            if not lean:
                engine._plain_round = lambda rows, e=engine: e._round(rows, 1)
            torch.manual_seed(5)
            out, stats = engine.generate(ids, mask)
            outs.append((out, stats.as_dict()))
        assert torch.equal(outs[0][0], outs[1][0]), do_sample
        assert outs[0][1] == outs[1][1], do_sample
        assert outs[0][1]["block_sizes"] == {1: outs[0][1]["rounds"]}
    greedy = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=1),
                    SamplingSettings(max_new_tokens=16, eos_token_ids=[EOS, eos], pad_token_id=PAD))
    out, _ = greedy.generate(ids, mask)
    assert torch.equal(out, hf_greedy(model, ids, mask, max_new_tokens=16, eos_token_id=[EOS, eos])[:, :out.shape[1]])
    assert bool((out[2, ids.shape[1]:] == PAD).any())  # the EOS stopped row 2 early


def test_first_draft_from_the_verifier(model):
    """`recguide_first_draft="verifier"`: d_1 is the seed's causal next-token prediction inside the draft
    forward, so greedy output = HF greedy and every LinearSS round accepts at least d_1 (RecGuide's rounds
    that reuse a branch got their block from the branch's mask positions)."""
    prompts = random_prompts(5, 96, min_len=1, max_len=20, seed=31)
    ids, mask = left_pad(prompts)
    ref = hf_greedy(model, ids, mask, max_new_tokens=25)
    for mode, block in (("linear", 2), ("linear", 8), ("recguide", 8), ("recguide", 16)):
        cfg = DecodingConfig(mode=mode, block_size=block, first_draft="verifier")
        settings = SamplingSettings(max_new_tokens=25, eos_token_ids=[EOS], pad_token_id=PAD)
        out, stats = Engine(as_backbone(model), cfg, settings).generate(ids, mask, log_rounds=True)
        assert torch.equal(out, ref[:, :out.shape[1]]) and out.shape == ref.shape, (mode, block)
        drafted = [(n, k) for _, _, n, k, _, _ in stats.round_log if k >= 1]
        assert drafted and (mode == "recguide" or all(n >= 1 for n, _ in drafted)), (mode, block)
        if mode == "linear":  # from the mask position instead, the random model's d_1 is rarely right
            base = Engine(as_backbone(model), DecodingConfig(mode=mode, block_size=block), settings)
            _, stats = base.generate(ids, mask, log_rounds=True)
            assert sum(n >= 1 for _, _, n, k, _, _ in stats.round_log if k >= 1) < len(drafted)
    with pytest.raises(ValueError, match="recguide_first_draft"):
        DecodingConfig(first_draft="seed")


def test_plain_steps_without_a_mask_when_rows_need_none(model):
    """A plain step over rows of one committed length runs with no mask (HF's own decoding path): the logits
    of the engine's 4D-masked forward to float rounding, HF's greedy output exactly; rows of different
    lengths keep the mask. Prompts enter the cache without their left padding."""
    seen = []

    class Spy(type(as_backbone(model))):
        unmasked_steps = True

        def forward(self, input_ids, position_ids, attention_mask, cache, draft_mask=None, logits_to_keep=0):
            logits = super().forward(input_ids, position_ids, attention_mask, cache, draft_mask, logits_to_keep)
            # a decoding step with no mask (a prefill of one token per row may run unmasked too: it sees only
            # itself) is run again with the explicit mask the engine would build
            if attention_mask is None and not logits_to_keep:
                lengths = cache.lengths[cache._binding.rows.cpu()]
                from recguide_hf.core.masks import build_mask, causal_intra
                full = build_mask(lengths, torch.zeros_like(lengths), causal_intra(len(lengths), 1),
                                  cache._binding.kv_len)
                seen.append((logits - super().forward(input_ids, position_ids, full, cache)).abs().max().item())
            return logits

    settings = SamplingSettings(max_new_tokens=12, eos_token_ids=[], pad_token_id=PAD)
    cfg = DecodingConfig(mode="linear", block_size=1)
    same_length = torch.tensor(random_prompts(3, 96, min_len=9, max_len=9, seed=2))
    out, _ = Engine(Spy(model), cfg, settings).generate(same_length)
    assert torch.equal(out, hf_greedy(model, same_length, None, max_new_tokens=12))
    assert len(seen) == 12 and max(seen) < 1e-5  # every step; the masked logits agree to float rounding
    seen.clear()
    prompts = random_prompts(3, 96, min_len=2, max_len=9, seed=2)
    ids, mask = left_pad(prompts)
    engine = Engine(Spy(model), cfg, settings)
    out, _ = engine.generate(ids, mask)
    assert torch.equal(out, hf_greedy(model, ids, mask, max_new_tokens=12)) and not seen  # lengths differ: masked
    # the cache holds no padding: every row's committed length is its own prompt + new tokens, seed excluded
    assert engine.slots.cache.lengths.tolist() == [len(p) + 12 - 1 for p in prompts] != [ids.shape[1] + 11] * 3
    # one request at a time (serving, prompts of different lengths padded to the widest): unmasked steps
    prompts = random_prompts(3, 96, min_len=2, max_len=9, seed=3)
    records = Engine(Spy(model), cfg, settings).serve(prompts, slots=1)
    assert len(seen) >= 3 * 12 and max(seen) < 1e-5  # every step (and a one-token prefill)
    for prompt, rec in zip(prompts, records):
        ref = hf_greedy(model, torch.tensor([prompt]), None, max_new_tokens=12, eos_token_id=None)
        assert rec["new_ids"] == ref[0, len(prompt):].tolist()


def test_parity_many_prompts_one_at_a_time():
    model = tiny_model(seed=3)
    for prompt in random_prompts(12, 96, max_len=30, seed=7):
        ids = torch.tensor([prompt])
        ref = hf_greedy(model, ids, None, max_new_tokens=17)
        out = recguide_hf.generate(model, ids, max_new_tokens=17, recguide_block_size=5)
        assert torch.equal(out, ref)


def test_max_new_tokens_smaller_than_block(model):
    ids, mask = left_pad(random_prompts(2, 96, seed=4))
    for n in (1, 3, 7):
        ref = hf_greedy(model, ids, mask, max_new_tokens=n)
        out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=n, recguide_block_size=16)
        assert torch.equal(out, ref)


def test_user_processors_parity(model):
    ids, mask = left_pad(random_prompts(3, 96, seed=5))
    kw = dict(max_new_tokens=20, repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[7], [9, 10]],
              min_new_tokens=5)
    ref = hf_greedy(model, ids, mask, **kw)
    out = recguide_hf.generate(model, ids, attention_mask=mask, recguide_block_size=6, **kw)
    assert torch.equal(out, ref)


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_per_row(model):
    ids, mask = left_pad(random_prompts(4, 96, seed=6))
    free = hf_greedy(model, ids, mask, max_new_tokens=20)
    stop_token = int(free[0, ids.shape[1] + 4])  # a token row 0 emits
    crit = lambda: StoppingCriteriaList([StopAfterToken(stop_token)])  # noqa: E731
    ref = hf_greedy(model, ids, mask, max_new_tokens=20, stopping_criteria=crit())
    out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=20, stopping_criteria=crit(),
                               recguide_block_size=8)
    assert torch.equal(out, ref)


def test_eos_inside_accepted_block():
    # true text has EOS at position 6; the drafter is perfect, so EOS arrives inside an accepted block
    true = [5 + (i % 40) for i in range(64)]
    true[6] = EOS
    mock = MockBackbone(true, list(true))
    cfg = DecodingConfig(mode="linear", block_size=8)
    engine = Engine(mock, cfg, SamplingSettings(max_new_tokens=20, eos_token_ids=[EOS], pad_token_id=2))
    seq, stats = engine.generate(torch.tensor([true[:2]]))
    assert seq[0, 2:].tolist() == true[2:7]  # up to and including EOS, nothing after
    assert stats.as_dict()["new_tokens"] == 5


def _hand_case():
    true = [10 + i for i in range(40)]
    drafts = list(true)
    drafts[3] = 50  # the drafter gets position 3 wrong (runner-up right, tiny margin)
    drafts[7] = 51  # and position 7
    return true, drafts


def test_linear_statistics_hand_computed():
    true, drafts = _hand_case()
    mock = MockBackbone(true, drafts)
    engine = Engine(mock, DecodingConfig(mode="linear", block_size=4), SamplingSettings(max_new_tokens=10))
    seq, stats = engine.generate(torch.tensor([true[:2]]))
    assert seq[0, 2:].tolist() == true[2:12]
    s = stats.as_dict()
    # round 1: [t1, d2, d3x, d4] accepts d2, recovers t3 (2 tokens); round 2: [t3, d4, d5, d6] all + bonus t7
    # (4 tokens); round 3: [t7, d8, d9, d10] all + bonus (4 tokens) -> 10 tokens, 3 rounds, 6 forwards
    assert (s["new_tokens"], s["rounds"], s["forwards"]) == (10, 3, 6)
    assert s["tau"] == pytest.approx(10 / 3) and s["tpf"] == pytest.approx(10 / 6)
    assert s["accepted_drafts"] == 1 + 3 + 3 and s["block_sizes"] == {4: 3}


def test_recguide_statistics_hand_computed():
    true, drafts = _hand_case()
    mock = MockBackbone(true, drafts)
    engine = Engine(mock, DecodingConfig(mode="recguide", block_size=4), SamplingSettings(max_new_tokens=10))
    seq, stats = engine.generate(torch.tensor([true[:2]]))
    assert seq[0, 2:].tolist() == true[2:12]
    s = stats.as_dict()
    # round 1: d3 is risky with correction t3 -> the first-correction branch hits, so round 2 needs no draft;
    # round 2's continuation guesses the bonus from the drafter (d7 wrong) -> miss; round 3 drafts again
    assert (s["rounds"], s["forwards"]) == (3, 5)
    assert s["hits"] == {"correction_1": 1, "correction_2": 0, "continuation": 0}
    assert s["forwards_saved"] == 1 and s["coverage"] == pytest.approx(1 / 3)
    # verify forwards carry the verifier segment and the branch segments in ONE row
    assert all(rows == 1 for rows, _, _ in mock.calls)


def test_batch_composition_does_not_change_output(model):
    prompts = random_prompts(6, 96, min_len=2, max_len=25, seed=9)
    ids, mask = left_pad(prompts)
    batched = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=15, recguide_block_size=4)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = recguide_hf.generate(model, torch.tensor([p]), max_new_tokens=15, recguide_block_size=4)
        new_alone = alone[0, len(p):].tolist()
        assert batched[i, width:width + len(new_alone)].tolist() == new_alone
        assert (batched[i, width + len(new_alone):] == 2).all()  # then only padding


@pytest.mark.parametrize("first_draft", ["mask", "verifier"])
def test_sampling_matches_verifier_distribution(first_draft):
    """Empirical distribution of the 2nd new token vs the exact verifier distribution (TV bound)."""
    model = tiny_model(seed=11, vocab=12, init_scale=0.08, layers=1)
    prompt = torch.tensor([[5, 7, 4]])
    n = 6000
    torch.manual_seed(0)
    gc = GenerationConfig(do_sample=True, top_k=None, temperature=1.0, max_new_tokens=2, eos_token_id=EOS,
                          pad_token_id=2, suppress_tokens=[MASK])
    out = recguide_hf.generate(model, prompt.expand(n, -1), generation_config=gc, recguide_block_size=4,
                               recguide_mode="linear", recguide_first_draft=first_draft)
    second = out[:, -1]
    with torch.no_grad():
        def probs(ids):
            logits = model(ids).logits[:, -1].float()
            logits[:, MASK] = float("-inf")
            return torch.softmax(logits, -1)
        p1 = probs(prompt)[0]
        exact = torch.zeros(12)
        for t in range(12):
            if t == EOS:  # the model's EOS ends the row; the 2nd slot is then padding (id 2)
                exact[2] += p1[t]
            elif p1[t] > 0:
                exact += p1[t] * probs(torch.cat([prompt, torch.tensor([[t]])], 1))[0]
    empirical = torch.bincount(second, minlength=12).float() / n
    tv = 0.5 * (empirical - exact).abs().sum()
    assert tv < 0.04, tv
    uniform = torch.full((12,), 1 / 11)
    uniform[MASK] = 0
    assert 0.5 * (uniform - exact).abs().sum() > 0.1  # the bound would catch a wrong distribution


def test_sampling_is_reproducible(model):
    ids, mask = left_pad(random_prompts(3, 96, seed=12))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                                         temperature=0.8, top_p=0.9, recguide_block_size=4))
    assert torch.equal(runs[0], runs[1])


def test_streams_layout_equals_fused(model):
    """The two-forward layout used by recguide_overlap='streams' (run sequentially on CPU) gives the same
    output and the same branch hits as the fused single forward."""
    true, drafts = _hand_case()
    results = []
    for split in (False, True):
        mock = MockBackbone(true, drafts)
        engine = Engine(mock, DecodingConfig(mode="recguide", block_size=4), SamplingSettings(max_new_tokens=10))
        engine.split_streams = split
        seq, stats = engine.generate(torch.tensor([true[:2]]))
        results.append((seq.tolist(), stats.as_dict()["hits"], stats.as_dict()["forwards"]))
    assert results[0] == results[1]
    ids, mask = left_pad(random_prompts(3, 96, seed=13))
    ref = hf_greedy(model, ids, mask, max_new_tokens=14)
    engine = Engine(recguide_hf.models.hf_backbone.HFBackbone(model), DecodingConfig(block_size=5),
                    SamplingSettings(max_new_tokens=14, eos_token_ids=[EOS], pad_token_id=2))
    engine.split_streams = True
    seq, _ = engine.generate(ids, mask)
    assert torch.equal(seq, ref)


def test_streams_fall_back_on_cpu_with_one_warning(model):
    import warnings

    from recguide_hf.core import engine as engine_module

    engine_module._WARNED.clear()
    ids = torch.tensor([[5, 6, 7]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = recguide_hf.generate(model, ids, max_new_tokens=6, recguide_overlap="streams")
        recguide_hf.generate(model, ids, max_new_tokens=6, recguide_overlap="streams")
    assert sum("needs CUDA" in str(w.message) for w in caught) == 1
    assert torch.equal(a, hf_greedy(model, ids, None, max_new_tokens=6))


def test_slot_reuse_matches_running_alone(model):
    """Continuous batching: 7 requests through 3 slots give each request its solo greedy output."""
    prompts = random_prompts(7, 96, min_len=1, max_len=18, seed=21)
    engine = Engine(recguide_hf.models.hf_backbone.HFBackbone(model), DecodingConfig(block_size=4),
                    SamplingSettings(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=2))
    records = engine.serve(prompts, slots=3)
    for prompt, rec in zip(prompts, records):
        ref = hf_alone(model, prompt, 12)
        assert rec["new_ids"] == ref
        assert rec["new_tokens"] == len(ref) and rec["latency"] > 0


def test_serve_plans_its_last_requests_as_one_static_batch(model):
    """`serve` returns when its last request is done: the policy plans by the rate rule while prompts wait for a
    slot, and for the batch's slowest request (`whole_batch`) once the last one is admitted. The outputs stay greedy."""
    from recguide_hf.core.policy import BlockPolicy

    seen = []

    class Spy(BlockPolicy):
        def plan(self, rows, pending_has, remaining=None):
            seen.append((len(engine.waiting), self.whole_batch))
            return super().plan(rows, pending_has, remaining)

    prompts = random_prompts(7, 96, min_len=1, max_len=18, seed=21)
    cfg = DecodingConfig(block_size=4)
    engine = Engine(recguide_hf.models.hf_backbone.HFBackbone(model), cfg,
                    SamplingSettings(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=2), policy=Spy(cfg))
    records = engine.serve(prompts, slots=3)
    assert {whole for waiting, whole in seen if waiting} == {False}  # a freed slot still takes the next prompt
    assert {whole for waiting, whole in seen if not waiting} == {True}
    for prompt, rec in zip(prompts[-3:], records[-3:]):  # the static batch's requests
        assert rec["new_ids"] == hf_alone(model, prompt, 12)


def test_prefill_in_length_groups_fills_the_cache_as_one_forward(model, monkeypatch):
    """Prompts of different lengths are prefilled in length-sorted groups; the committed cache equals the
    one padded forward's, to float rounding, and decoding stays HF greedy."""
    import recguide_hf.core.engine as engine_module

    prompts = random_prompts(6, 96, min_len=1, max_len=30, seed=4)
    ids, mask = left_pad(prompts)
    assert len(engine_module.length_groups((mask.sum(1) - 1).tolist())) > 1  # several groups, really
    settings = SamplingSettings(max_new_tokens=0, eos_token_ids=[], pad_token_id=PAD)
    caches = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(engine_module, "length_groups", lambda lengths: [list(range(len(lengths)))])
        engine = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=4), settings)
        engine.generate(ids, mask)
        caches.append(engine.slots.cache)
    grouped, single = caches
    assert torch.equal(grouped.lengths, single.lengths)
    for layer in range(len(grouped.keys)):
        for r, n in enumerate(grouped.lengths.tolist()):
            assert torch.allclose(grouped.keys[layer][r, :, :n], single.keys[layer][r, :, :n], atol=1e-5)
            assert torch.allclose(grouped.values[layer][r, :, :n], single.values[layer][r, :, :n], atol=1e-5)
    monkeypatch.undo()
    out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=16, recguide_mode="linear",
                               recguide_block_size=4)
    assert torch.equal(out, hf_greedy(model, ids, mask, max_new_tokens=16))


def test_a_whole_batch_stop_leaves_the_token_counts_true():
    """A criterion returning one bool for the batch ends every row where it is: the bucket that ran first this
    round (B = 4) keeps the tokens it was judged on, the bucket that hit the stop (B = 8) is cut at it, and the
    per-request token counts say exactly what each row emitted."""
    true = [10 + i for i in range(200)]

    class TwoBuckets(BlockPolicy):
        def plan(self, rows, pending_has, remaining=None):
            return torch.where(rows % 2 == 0, 8, 4)

    class AnyRowAt(StoppingCriteria):
        def __init__(self, width, n):
            self.width, self.n = width, n

        def __call__(self, input_ids, scores, **kwargs):
            return bool(((input_ids[:, self.width:] != PAD).sum(1) >= self.n).any())

    cfg = DecodingConfig(mode="linear", block_size=8)
    prompts = torch.tensor([true[:3]] * 4)
    engine = Engine(MockBackbone(true, list(true)), cfg, SamplingSettings(max_new_tokens=32, pad_token_id=PAD),
                    stopper=StopChecker([AnyRowAt(3, 6)], PAD), policy=TwoBuckets(cfg))
    seq, stats = engine.generate(prompts)
    emitted = (seq[:, 3:] != PAD).sum(1)
    assert emitted.tolist() == [6, 4, 6, 4]  # the B = 8 rows' round was cut at token 6
    assert stats.new_tokens.tolist() == emitted.tolist() == engine.slots.count.tolist()
    assert stats.as_dict()["new_tokens"] == int(emitted.sum())


@pytest.mark.slow
def test_compiled_serving_stays_compiled():
    """Closed-loop serving at C = 2 and 3 with every forward kind (prefills, plain steps and B = 8 rounds in
    separate buckets, draft, verify and branch forwards, all rows and subsets): the compiled engine gives plain HF
    greedy's tokens and never hits dynamo's recompile limit. One compiled `Backbone.forward` did at C = 2 (its
    ninth graph variant), and from there ran eagerly: the per-kind functions and the cache's uniform paths keep
    each kind's graphs few (compiled.py). The forwards read the cache's rows in runs through one op (attention.py)."""
    import torch._dynamo

    from recguide_hf.models import attention

    torch._dynamo.reset()
    model = tiny_model(seed=5)
    settings = SamplingSettings(max_new_tokens=14, eos_token_ids=[EOS], pad_token_id=PAD)

    def serve_and_check(mode, slots, prompts):
        cfg = DecodingConfig(mode=mode, block_size=8, compile=True)
        records = Engine(as_backbone(model), cfg, settings, policy=Alternate(cfg)).serve(prompts, slots=slots)
        for prompt, record in zip(prompts, records):
            ref = hf_greedy(model, torch.tensor([prompt]), None, max_new_tokens=14)[0, len(prompt):]
            assert record["new_ids"] == ref.tolist(), (mode, slots)

    calls, traced = [], attention._attend_runs

    def counting(module, query, key, value, mask, runs, **kwargs):
        calls.append(len(runs))
        return traced(module, query, key, value, mask, runs, **kwargs)

    attention._attend_runs = counting  # what the runs op runs (the prefills are eager and read no runs)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for mode, slots in (("linear", 2), ("recguide", 3)):
                serve_and_check(mode, slots, random_prompts(7, 96, min_len=2, max_len=30, seed=17))
    finally:
        attention._attend_runs = traced
    # the compiled forwards read the cache's rows in runs through the op, subsets of rows among them
    assert calls and max(calls) > 1


@pytest.mark.slow
def test_compiled_forward_gives_eager_tokens():
    """`recguide_compile=True` (the backbone's forward through torch.compile, dynamic shapes): the same greedy tokens
    as plain HF greedy, for LinearSS and RecGuide (branches ride: no cost table), batched and left-padded; the first
    call reports the seconds it spent compiling, a repeated call compiles nothing."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model(seed=11)
    ids, mask = left_pad(random_prompts(3, 96, min_len=2, max_len=9, seed=13))
    ref = hf_greedy(model, ids, mask, max_new_tokens=12)
    warmups = []
    for mode in ("linear", "recguide", "recguide"):
        out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=12, recguide_mode=mode,
                                   recguide_block_size=4, recguide_compile=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref[:, :out.sequences.shape[1]]) and out.sequences.shape == ref.shape, mode
        warmups.append(out.recguide_stats["compile_warmup_s"])
    assert warmups[0] > 0  # the first call compiled
    assert warmups[2] == 0  # the same forwards again: nothing new to compile
    # plain decoding steps (B = 1) run unmasked; transformers builds their mask from the cache's query offset, a
    # host int of the binding (RowCache.get_query_offset), so the compiled step reads no tensor value: no graph break
    from torch._dynamo.utils import counters
    from transformers import Cache

    counters["graph_break"].clear()
    out = recguide_hf.generate(model, ids, attention_mask=mask, max_new_tokens=12, recguide_mode="linear",
                               recguide_block_size=1, recguide_compile=True)
    assert torch.equal(out, ref[:, :out.shape[1]])
    if hasattr(Cache, "get_query_offset"):  # transformers 5.24 (5.0 asks get_seq_length: a break inside HF's code)
        assert not counters["graph_break"], dict(counters["graph_break"])
