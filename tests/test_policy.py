"""Adaptive drafting: signals, V fitting with a known answer, policy choices, bucketing, branch rule."""

import json
import math

import pytest
import torch
from conftest import EOS, PAD, left_pad, random_prompts
from mock_backbone import MockBackbone

from recguide_hf.core.calibrate import Round, ValueTable, fit
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.costs import CostTable
from recguide_hf.core.engine import Engine, SamplingSettings, verifier_entropy
from recguide_hf.core.policy import BlockPolicy, RoundOutcome, _largest_of, _rounds_to_make, _to_the_limit
from recguide_hf.models.registry import as_backbone


def test_entropy_over_causally_valid_positions_only():
    v = 4
    uniform = torch.zeros(v)  # entropy ln 4
    peaked = torch.tensor([100.0, 0.0, 0.0, 0.0])  # entropy ~0
    scores = torch.stack([torch.stack([uniform, peaked, uniform, uniform])])  # [1, 4, V]
    # one draft accepted: positions 0 and 1 are valid (the first mismatch is at index 1), 2 and 3 are not
    e = verifier_entropy(scores, torch.tensor([1]), torch.tensor([4]))
    assert e.item() == pytest.approx(math.log(4) / 2, abs=1e-4)
    e_full = verifier_entropy(scores, torch.tensor([3]), torch.tensor([4]))
    assert e_full.item() == pytest.approx(3 * math.log(4) / 4, abs=1e-4)


def _synthetic_rounds():
    """Two kinds of requests: low entropy -> 20 drafts accepted, high entropy -> 2 accepted."""
    rounds = []
    for dataset in ("a", "b"):
        for req in range(20):
            confident = req % 2 == 0
            for t in range(6):
                rounds.append(Round(dataset, req, t, 0.1 if confident else 3.0, 20 if confident else 2))
    return rounds


def test_value_fit_known_answer():
    table = fit(_synthetic_rounds(), block_sizes=(8, 16, 32), num_bins=2, folds=5)
    vt = ValueTable(table)
    s_conf, s_unsure = -0.1, -3.0
    # after a confident round the previous block of 8 was fully accepted (20 >= 7)
    assert vt.value(8, s_conf, 8, True) == pytest.approx(8)  # min(20, 7) + 1
    assert vt.value(32, s_conf, 32, False) == pytest.approx(21)  # 20 drafts + 1
    assert vt.value(32, s_unsure, 32, False) == pytest.approx(3)
    assert vt.value(8, s_unsure, 8, False) == pytest.approx(3)
    # the signal separates the two kinds perfectly: out-of-fold error is ~0, far below a constant's
    assert table["report"]["rmse"]["32"] < 1e-6 < table["report"]["rmse_constant"]["32"]
    assert table["shrink_signal"]["32"] == pytest.approx(1.0)  # so the policy trusts it fully



def test_the_state_after_plain_steps_is_read_on_the_plain_scale():
    """A plain step reads the entropy of one place, so the state after one (B' = 1) is fitted on `f_t`, the
    entropy at the calibration block's first place. Here a block round's mean entropy is the same for both
    kinds of request (their accepted places are sure) and only the first place tells them apart: the table
    after a block of 8 cannot separate them, the table after plain steps can. Rounds logged without `f_t`
    (older logs) fall back to the block scale."""
    rounds = [Round("a", req, t, 0.5, 20 if req % 2 == 0 else 10, 0.2 if req % 2 == 0 else 4.0)
              for req in range(40) for t in range(6)]  # both kinds fill a block of 8: the state cannot tell
    vt = ValueTable(fit(rounds, block_sizes=(1, 8, 16), num_bins=2))
    assert vt.value(16, -0.2, 1, True) == pytest.approx(16) and vt.value(16, -4.0, 1, True) == pytest.approx(11)
    assert vt.value(16, -0.5, 8, True) == pytest.approx(vt.mean[16]) == pytest.approx(13.5)
    old = ValueTable(fit([Round(r.dataset, r.request, r.t, r.entropy, r.accepted) for r in rounds],
                         block_sizes=(1, 8, 16), num_bins=2))
    assert old.value(16, -4.0, 1, True) == pytest.approx(old.mean[16])


def test_calibration_logs_the_first_places_entropy(model):
    """The round log carries each block round's entropy at its first place (a plain step's reading), the
    mean over its valid places, and for a plain step the one place's entropy as both."""
    ids, mask = left_pad(random_prompts(3, 96, min_len=2, max_len=9, seed=8))
    for block in (1, 8):
        engine = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=block),
                        SamplingSettings(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=PAD))
        _, stats = engine.generate(ids, mask, log_rounds=True)
        assert stats.round_log and all(len(entry) == 6 for entry in stats.round_log)
        for _, b, n, _, e, f in stats.round_log:
            assert b == block and f > 0 and not math.isnan(e)
            if block == 1 or n == 0:  # one valid place: both readings are that place's
                assert f == pytest.approx(e)
        assert any(f != pytest.approx(e) for _, _, n, _, e, f in stats.round_log if n > 0) or block == 1


def _tables(flat_cost: bool, blocks=(8, 16, 32), step: float | None = None):
    """Hand-made costs (flat, or growing with C and B) and the synthetic values; `step` = cost of a B=1 step."""
    costs = {}
    for c in (1, 8, 64):
        costs[str(c)] = {}
        for b in blocks:
            t = 0.01 if flat_cost else 0.01 * c * b / 8
            costs[str(c)][str(b)] = {"draft": t, "verify": [t, t * 1.1, t * 1.2, t * 1.3]}
        if step is not None:
            costs[str(c)]["1"] = {"draft": 0.0, "verify": [step] * 4}
    values = fit(_synthetic_rounds(), block_sizes=blocks, num_bins=2)
    return CostTable({"costs": costs}), ValueTable(values)


def choose(policy, c, s, prev, full):
    """The block the policy plans for a request with certainty s and state (prev, full), C requests in flight."""
    policy.start(c)
    policy.signals.entropy[:] = -s  # two rounds of history with entropy -s each
    policy.signals.last_block[:] = prev
    policy.signals.last_full[:] = full
    return int(policy.plan(torch.arange(c), torch.zeros(c, dtype=torch.bool))[0])


def test_policy_choices_for_hand_made_tables():
    cfg = DecodingConfig(block_size="auto")
    costs, values = _tables(flat_cost=True)
    flat = BlockPolicy(cfg, costs, values)
    assert flat.candidates == [8, 16, 32]  # by default: what the cost table measured
    assert choose(flat, 1, -0.1, 32, False) == 32  # confident and cost flat in B: draft long
    costs, values = _tables(flat_cost=False)
    steep = BlockPolicy(cfg, costs, values)
    assert choose(steep, 64, -3.0, 32, False) == 8  # unsure and cost grows with B: draft short
    # confident at high load: 32 loses once time is priced (V 21 for twice 16's time; 8 and 16 make their 8 and
    # 16 tokens at one rate, 6.25 a second, above 32's 4.1) ...
    assert choose(steep, 64, -0.1, 16, True) in (8, 16)
    zero_rho = BlockPolicy(DecodingConfig(block_size="auto", rho=0.0), costs, values)
    assert choose(zero_rho, 64, -0.1, 16, True) == 32  # ... but not with rho = 0: the choice of rho matters


def test_plain_step_is_the_fallback_when_drafts_do_not_pay():
    """B = 1 (V_1 = 1 exactly, no draft forward) wins for unsure requests when a step costs less than a third
    of a B=8 round, and loses to speculation for confident ones; no concurrency threshold is involved."""
    costs, values = _tables(flat_cost=True, step=0.006)
    assert values.value(1, -3.0, 8, False) == 1.0 and values.mean[1] == 1.0  # never calibrated, exact
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    assert policy.candidates == [1, 8, 16, 32]
    assert choose(policy, 8, -3.0, 8, False) == 1  # 3 tokens for 0.02 s < 1 token for 0.006 s
    assert choose(policy, 8, -0.1, 1, True) == 32  # and back to speculation the next round, from state B=1
    narrowed = BlockPolicy(DecodingConfig(block_size="auto", block_sizes=(8, 16, 32)), costs, values)
    assert choose(narrowed, 8, -3.0, 8, False) == 8  # the paper's set: no fallback


def test_a_hard_stretch_is_drafted_through_while_blocks_make_tokens_faster_than_plain_steps():
    """An unsure request (3 tokens a round at any block, for 0.02 s) where a plain step costs 0.01 s: the block
    makes its tokens at 150 a second, plain steps at 100, so it drafts. Time valued at the best fixed block's
    average rate instead (rho = mean V_32 / 0.02 s = 600 tokens a second: the earlier rule) made every second
    look dear there and took plain steps through the stretch. Where plain steps are the faster (0.006 s: 167 a
    second) both take them."""
    costs, values = _tables(flat_cost=True, step=0.01)
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    assert values.value(8, -3.0, 8, False) == pytest.approx(3.0) and values.mean[32] == pytest.approx(12.0)
    assert choose(policy, 8, -3.0, 8, False) == 8  # 8, 16 and 32 tie at 150 a second: the smallest
    average_rate = BlockPolicy(DecodingConfig(block_size="auto", rho=600.0), costs, values)
    assert choose(average_rate, 8, -3.0, 8, False) == 1
    costs, values = _tables(flat_cost=True, step=0.006)
    for rho in (None, 600.0):
        assert choose(BlockPolicy(DecodingConfig(block_size="auto", rho=rho), costs, values), 8, -3.0, 8, False) == 1


def test_a_request_near_its_limit_is_valued_at_what_it_may_still_emit():
    """A round yields at most the tokens its request may still emit, and a leftover short of a steady round
    costs one more round: a confident request that drafts 32 with plenty left takes a plain step one token
    from its limit, a cheaper block three tokens from it, and still finishes in one B = 32 round twelve from it
    (flat prices: V_8 / V_16 / V_32 = 5.5 / 9.5 / 12 for the same 0.02 s; a plain step 1 token for 0.006 s)."""
    costs, values = _tables(flat_cost=True, step=0.006)
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)

    def planned(remaining):
        policy.start(1)
        policy.signals.entropy[:] = 0.1  # confident: V_32 = 12
        policy.signals.last_block[:] = 32
        policy.signals.last_full[:] = True
        left = None if remaining is None else torch.tensor([remaining])
        return int(policy.plan(torch.arange(1), torch.zeros(1, dtype=torch.bool), left)[0])

    assert planned(None) == planned(64) == planned(12) == 32
    assert planned(1) == 1  # was 32: V_32 = 12 for a round that can emit one token
    assert planned(3) == 8  # min(V_B, 3) = 3 for every B > 1 at the same price: the leftover decides
    assert planned(6) in (16, 32)  # V_16 >= 6 finishes it; a plain step would leave 5 for another round


def test_a_round_near_the_limit_is_never_worth_less_than_nothing():
    """Five tokens left in a hard stretch (3 a round at B = 8 and 16, 1 at B = 1) with a steady round of 12: every
    size leaves a leftover that costs one more dear round (B = 8's: 12 token-equivalents for 2 tokens), so each is
    worth less than nothing. It reads 0: per second, a negative worth would favour the longest round; at 0 each
    plan ties and the cheapest (first) size is taken. A size that finishes the request keeps its worth."""
    means, price = [1.0, 5.5, 12.0], [3.6, 12.0, 12.0]
    assert _to_the_limit([[1.0, 3.0, 3.0]], [5], means, price) == [[0.0, 0.0, 0.0]]
    assert _to_the_limit([[1.0, 3.0, 6.0]], [5], means, price) == [[0.0, 0.0, 5.0]]


def test_the_engine_work_of_a_round_is_priced_too():
    """`host` (the engine's work per round outside the forwards, `recguide profile`) is part of a round's cost:
    every round pays it, plain steps included, so when it is large next to a plain step more rounds of one
    token stop paying and the unsure request that took B = 1 drafts again. A table without it reads 0."""
    costs, values = _tables(flat_cost=True, step=0.006)
    assert costs.host(8, 8) == 0.0 and costs.round_cost(8, 8) == pytest.approx(0.02)
    assert choose(BlockPolicy(DecodingConfig(block_size="auto"), costs, values), 8, -3.0, 8, False) == 1
    for per_b in costs.data["costs"].values():
        for entry in per_b.values():
            entry["host"] = 0.1
    costs = CostTable(costs.data)
    assert costs.host(8, 1) == 0.1 and costs.round_cost(8, 8) == pytest.approx(0.12)
    assert choose(BlockPolicy(DecodingConfig(block_size="auto"), costs, values), 8, -3.0, 8, False) > 1


def test_host_time_is_measured_over_free_forwards(model, monkeypatch):
    """The profiler's engine-work timer runs real engine rounds over a forward that costs nothing and rejects
    every draft: one token per round, so the slope between two run lengths is seconds per round."""
    from recguide_hf.models.registry import as_backbone
    from recguide_hf.tools.profile import _FreeForward, _host_timer

    bb = as_backbone(model)
    free = _FreeForward(bb, 3, 8)
    engine = Engine(free, DecodingConfig(mode="linear", block_size=8), SamplingSettings(max_new_tokens=9))
    out, stats = engine.generate(torch.full((3, 5), 4))
    assert stats.as_dict()["rounds"] == 27 and stats.as_dict()["accepted_drafts"] == 0
    assert out[:, 5:].unique().numel() == 1  # every round emits the verifier's token at place 0
    import recguide_hf.core.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "verifier_entropy",
                        lambda *args, real=engine_module.verifier_entropy: calls.append(1) or real(*args))
    for b in (1, 8):
        calls.clear()
        assert 0.0 < _host_timer(bb, 3, b)() < 0.1
        assert calls  # the certainty signal is part of the timed rounds, as under the auto policy


def test_profile_table_has_every_part_of_a_round(model):
    from recguide_hf.tools.profile import profile_costs

    table = profile_costs(model, concurrencies=(1, 2), block_sizes=(1, 4), prefix_len=16, repeats=1)
    costs = CostTable(table)
    assert costs.concurrencies == [1, 2] and costs.block_sizes == [1, 4]
    for c in ("1", "2"):
        step, block = table["costs"][c]["1"], table["costs"][c]["4"]
        assert step["draft"] == 0.0 and len(set(step["verify"])) == 1  # a plain step: no draft, no branches
        assert block["draft"] > 0 and len(block["verify"]) == 4
        # the engine's own work is a part of every round (its size is a timing: > 0 on a quiet host, but the slope
        # of two short runs can read 0 under load, so only its presence is asserted here)
        assert set(step) == set(block) == {"draft", "verify", "host"}
        assert costs.round_cost(int(c), 4) == pytest.approx(block["draft"] + block["verify"][0] + block["host"])


def test_a_compiled_engine_reads_the_compiled_cost_table(tmp_path):
    def table(draft):
        return {"costs": {"1": {"8": {"draft": draft, "verify": [0.01, 0.02, 0.03, 0.04], "host": 0.0}}}}

    (tmp_path / "cost_table.json").write_text(json.dumps(table(0.05)))
    config = DecodingConfig(block_size=8, cost_table="cost_table.json")
    assert BlockPolicy.from_config(config, tmp_path).costs.draft(1, 8) == 0.05
    compiled = DecodingConfig(block_size=8, cost_table="cost_table.json", compile=True)
    assert BlockPolicy.from_config(compiled, tmp_path).costs.draft(1, 8) == 0.05  # none measured: the eager one
    (tmp_path / "cost_table_compiled.json").write_text(json.dumps(table(0.002)))
    assert BlockPolicy.from_config(compiled, tmp_path).costs.draft(1, 8) == 0.002
    assert BlockPolicy.from_config(config, tmp_path).costs.draft(1, 8) == 0.05


def _plan_mixed(costs, values, c=8):
    """Plan a batch of c requests, the even ones confident (s = -0.1), the odd ones unsure (s = -3.0)."""
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    policy.start(c)
    policy.signals.entropy[:] = torch.where(torch.arange(c) % 2 == 0, 0.1, 3.0)[:, None]
    policy.signals.last_block[:] = 8
    policy.signals.last_full[:] = torch.arange(c) % 2 == 0
    return policy.plan(torch.arange(c), torch.zeros(c, dtype=torch.bool))


def _costs(fixed: float, per_row: float, per_token: float, blocks=(1, 8, 16, 32)):
    """A forward of c rows x b tokens costs `fixed + c (per_row + per_token b)` (B = 1: a plain step, no draft)."""
    costs = {}
    for c in (1, 8, 64):
        costs[str(c)] = {}
        for b in blocks:
            t = fixed + c * (per_row + per_token * b)
            costs[str(c)][str(b)] = {"draft": 0.0 if b == 1 else t, "verify": [t] * 4}
    return CostTable({"costs": costs})


def test_a_bucket_split_must_pay_for_its_forwards():
    """The round is priced as the sum of its buckets' forwards: when a forward's fixed cost dominates, a
    mixed batch runs at ONE block size; when cost is per token, confident and unsure requests split."""
    values = ValueTable(fit(_synthetic_rounds(), block_sizes=(8, 16, 32), num_bins=2))
    fixed = _plan_mixed(_costs(fixed=0.02, per_row=0.0, per_token=1e-6), values)
    assert fixed.unique().numel() == 1
    per_row = _plan_mixed(_costs(fixed=0.0, per_row=1e-3, per_token=1e-4), values)
    confident, unsure = per_row[::2].unique().tolist(), per_row[1::2].unique().tolist()
    assert unsure == [1] and len(confident) == 1 and confident[0] >= 8


def test_a_signal_that_does_not_predict_is_not_trusted():
    """Acceptance independent of the entropy signal: out of fold the table does not beat the constant, its
    shrink is ~0 and every state reads close to the block's mean (an informative signal keeps shrink 1:
    test_value_fit_known_answer)."""
    g = torch.Generator().manual_seed(0)
    rounds = [Round("a", req, t, float(torch.rand(1, generator=g)) * 4, int(torch.randint(0, 30, (1,), generator=g)))
              for req in range(60) for t in range(8)]
    table = fit(rounds, block_sizes=(8, 16, 32), num_bins=4)
    assert table["shrink_signal"]["32"] < 0.3
    vt = ValueTable(table)
    spread = [vt.value(32, s, 32, False) for s in (-3.9, -2.5, -1.5, -0.1)]
    raw = ValueTable({k: v for k, v in table.items() if not k.startswith("shrink")})
    raw_spread = [raw.value(32, s, 32, False) for s in (-3.9, -2.5, -1.5, -0.1)]
    assert max(spread) - min(spread) <= 0.3 * (max(raw_spread) - min(raw_spread))


def _state_rounds(num_requests: int = 80):
    """Acceptance set by the request's kind (20 drafts or 2) and entropy drawn at random: after a block of 8 the
    state (was it fully accepted?) tells the kinds apart, the entropy signal never does."""
    g = torch.Generator().manual_seed(1)
    return [Round("a", req, t, float(torch.rand(1, generator=g)) * 4, 20 if req % 2 == 0 else 2)
            for req in range(num_requests) for t in range(8)]


def test_an_informative_state_does_not_carry_the_signals_noise():
    """The state and the signal are trusted apart: here the state predicts progress perfectly and the entropy
    not at all, so the table keeps the state's separation in full and reads (almost) no spread across the
    entropy bins; one lambda for both parts kept most of the bins' noise along with the state."""
    table = fit(_state_rounds(), block_sizes=(8, 16, 32), num_bins=4)
    assert table["shrink_state"]["16"] == pytest.approx(1.0)
    vt = ValueTable(table)
    after_full = [vt.value(16, s, 8, True) for s in (-3.9, -2.5, -1.5, -0.1)]
    after_miss = [vt.value(16, s, 8, False) for s in (-3.9, -2.5, -1.5, -0.1)]
    assert after_full == pytest.approx([16.0] * 4) and after_miss == pytest.approx([3.0] * 4)  # min(20, 15) + 1
    # after a block of 32 neither kind filled it: only the (uninformative) signal could separate them
    raw = ValueTable({k: v for k, v in table.items() if not k.startswith("shrink") and k != "state_mean"})
    spread = [vt.value(32, s, 32, False) for s in (-3.9, -2.5, -1.5, -0.1)]
    raw_spread = [raw.value(32, s, 32, False) for s in (-3.9, -2.5, -1.5, -0.1)]
    assert max(spread) - min(spread) <= 0.3 * (max(raw_spread) - min(raw_spread))
    # a table from before the two-part shrink (one `shrink`, no state means) reads as it did: mean + lambda (V - mean)
    legacy = {k: v for k, v in table.items() if not k.startswith("shrink") and k != "state_mean"}
    legacy["shrink"] = {b: 0.5 for b in table["mean"]}
    old = ValueTable(legacy)
    v_raw = raw.value(16, -2.5, 8, True)
    assert old.value(16, -2.5, 8, True) == pytest.approx(table["mean"]["16"] + 0.5 * (v_raw - table["mean"]["16"]))


def test_a_table_that_trusts_no_signal_bins_skips_the_entropy_pass(model):
    """With lambda_s = 0 every entropy bin of a state reads alike, so the policy plans from the state alone
    (also with no entropy recorded: NaN) and the engine computes no verifier entropy; with lambda_s > 0 it does."""
    table = fit(_state_rounds(), block_sizes=(1, 8, 16, 32), num_bins=4)
    trusted = ValueTable(table)
    table_off = dict(table, shrink_signal={b: 0.0 for b in table["mean"]})
    values = ValueTable(table_off)
    assert not values.reads_signal and (trusted.reads_signal == any(v > 0 for v in table["shrink_signal"].values()))
    nan = torch.tensor([float("nan")] * 2)
    read = values.values_matrix([8, 16], nan, torch.tensor([8, 8]), torch.tensor([True, False]))
    assert read.flatten().tolist() == pytest.approx([8.0, 16.0, 3.0, 3.0])  # the states, not the blocks' means
    assert values.value(16, None, 8, True) == pytest.approx(16.0)
    costs, _ = _tables(flat_cost=True, blocks=(1, 8, 16, 32), step=0.006)
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    assert not policy.reads_entropy
    engine = Engine(as_backbone(model), DecodingConfig(block_size="auto"), SamplingSettings(max_new_tokens=8),
                    policy=policy)
    assert not engine.wants_entropy
    table_on = dict(table, shrink_signal={b: 0.5 for b in table["mean"]})
    assert BlockPolicy(DecodingConfig(block_size="auto"), costs, ValueTable(table_on)).reads_entropy


def test_block_sizes_outside_the_tables_are_refused():
    costs, values = _tables(flat_cost=True)
    with pytest.raises(ValueError, match=r"\[4\].*cost table"):
        BlockPolicy(DecodingConfig(block_size="auto", block_sizes=(4, 8)), costs, values)


def test_vectorised_values_equal_the_scalar_lookup():
    table = fit(_synthetic_rounds(), block_sizes=(1, 8, 16, 32), num_bins=4)
    vt = ValueTable(table)
    g = torch.Generator().manual_seed(0)
    s = -4 * torch.rand(50, generator=g)
    s[:3] = float("nan")
    prev = torch.tensor([1, 8, 16, 32, 5])[torch.randint(0, 5, (50,), generator=g)]
    full = torch.rand(50, generator=g) < 0.5
    matrix = vt.values_matrix([16, 1, 32, 8], s, prev, full)  # the policy's one lookup per round
    for k, b in enumerate((16, 1, 32, 8)):
        fast = vt.values_for(b, s, prev, full).tolist()
        slow = [vt.value(b, None if math.isnan(si) else si, pi, fi) for si, pi, fi in
                zip(s.tolist(), prev.tolist(), full.tolist())]
        assert fast == pytest.approx(slow) == matrix[:, k].tolist(), b
    # the policy's per-request reading: the same numbers, memoised per state and signal bin
    rows = [vt.row((16, 1, 32, 8), si, pi, fi) for si, pi, fi in zip(s.tolist(), prev.tolist(), full.tolist())]
    assert [list(r) for r in rows] == matrix.double().tolist()
    first = vt.row((16, 1, 32, 8), float("nan"), 0, False)  # no round yet
    assert list(first) == vt.values_matrix([16, 1, 32, 8], torch.tensor([float("nan")]), torch.tensor([0]),
                                           torch.tensor([False]))[0].double().tolist()


def test_branch_rule_follows_measured_costs():
    cfg = DecodingConfig(block_size=16)
    cheap = CostTable({"costs": {"1": {"16": {"draft": 0.01, "verify": [0.01, 0.0101, 0.0102, 0.0103]}}}})
    dear = CostTable({"costs": {"1": {"16": {"draft": 0.01, "verify": [0.01, 0.02, 0.03, 0.04]}}}})
    assert BlockPolicy(cfg, cheap).branches_on(1, 16)
    assert not BlockPolicy(cfg, dear).branches_on(1, 16)


def test_branches_pay_only_for_the_draft_work_they_remove():
    """A branch hit lets its row skip the next draft forward, but the forward still runs for the rows that missed.
    With a draft forward as dear for 4 rows as for 1 (memory-bound) and a hit rate of 1/3 (the prior), branches
    pay at 1 row (saving h x 10 ms > 1 ms of extra verify) and not at 4 rows (saving ~ h^4 x 10 ms = 0.12 ms);
    where the draft forward's cost grows with its rows they still pay at 4 rows (4 x 10 ms less 4 x 2/3 x 10 ms)."""
    cfg = DecodingConfig(block_size=16)

    def table(draft_at_4):
        verify = [0.01, 0.0105, 0.011, 0.0115]  # 2 segments per row (the prior) add 1 ms
        return CostTable({"costs": {"1": {"16": {"draft": 0.01, "verify": verify}},
                                    "4": {"16": {"draft": draft_at_4, "verify": verify}}}})

    flat, growing = BlockPolicy(cfg, table(0.01)), BlockPolicy(cfg, table(0.04))
    assert flat.branches_on(1, 16) and not flat.branches_on(4, 16)
    assert growing.branches_on(1, 16) and growing.branches_on(4, 16)
    assert flat._draft_saved(4, 16, 1.0) == pytest.approx(0.01) and flat._draft_saved(4, 16, 0.0) == 0.0


def test_bucketing_one_forward_per_bucket():
    true = [10 + i for i in range(200)]
    mock = MockBackbone(true, list(true))

    class TwoBuckets(BlockPolicy):
        def plan(self, rows, pending_has, remaining=None):
            return torch.where(rows % 2 == 0, 4, 8)

    cfg = DecodingConfig(mode="linear", block_size=8)
    engine = Engine(mock, cfg, SamplingSettings(max_new_tokens=8), policy=TwoBuckets(cfg))
    engine.generate(torch.tensor([true[:3]] * 4))
    decode = mock.calls[1:]  # after the prefill
    # round 1: bucket B=4 (rows 0, 2) draft + verify, bucket B=8 (rows 1, 3) draft + verify; each forward has 2 rows
    assert [(rows, q) for rows, q, _ in decode[:4]] == [(2, 4), (2, 4), (2, 8), (2, 8)]


def _timed(num_rows: int, block: int, seconds: float, accepted: float = 0.0) -> RoundOutcome:
    """A bucket round of `num_rows` rows at `block` that took `seconds`, each row accepting `accepted` drafts."""
    return RoundOutcome(torch.arange(num_rows), block, torch.full((num_rows,), accepted),
                        torch.full((num_rows,), block - 1), seconds=seconds)


def _plan_score(plan, v, costs, rho=None):
    """Expected tokens per second of the plan's summed bucket seconds, or with a set rho expected tokens minus
    C rho x those seconds (policy.py's rule, by hand)."""
    c = len(plan)
    buckets = {b: plan.count(b) for b in set(plan)}
    tokens, seconds = sum(v[r][plan[r]] for r in range(c)), sum(costs.round_cost(n, b) for b, n in buckets.items())
    return tokens / seconds if rho is None else tokens - c * rho * seconds


@pytest.mark.parametrize("rho", [None, 300.0])
def test_plan_is_the_best_of_the_weighed_plans(rho):
    """Brute force: the chosen plan scores, by the module's rule (expected tokens per second of the summed bucket
    seconds; with `recguide_rho` set, tokens - C rho x those seconds), the max over every-request-at-one-B plans
    and the each-at-its-own-B plan."""
    costs = _costs(fixed=0.0005, per_row=1e-3, per_token=1e-4)
    values = ValueTable(fit(_synthetic_rounds(), block_sizes=(8, 16, 32), num_bins=2))
    policy = BlockPolicy(DecodingConfig(block_size="auto", rho=rho), costs, values)
    g = torch.Generator().manual_seed(1)
    mixed = 0
    for trial in range(20):
        c = int(torch.randint(1, 9, (1,), generator=g))
        policy.start(c)
        stats = policy.signals
        stats.entropy[:] = torch.where(torch.rand(c, generator=g) < 0.5, 0.1, 3.0)[:, None]
        stats.last_block[:] = torch.tensor([1, 8, 16, 32])[torch.randint(0, 4, (c,), generator=g)]
        stats.last_full[:] = torch.rand(c, generator=g) < 0.5
        chosen = policy.plan(torch.arange(c), torch.zeros(c, dtype=torch.bool)).tolist()
        s = [-0.1 if e < 1 else -3.0 for e in stats.entropy[:, 0].tolist()]
        v = [{b: values.value(b, s[r], int(stats.last_block[r]), bool(stats.last_full[r])) for b in policy.candidates}
             for r in range(c)]

        def own_score(vb, t):
            return vb / t if rho is None else vb - rho * t

        own = [max(policy.candidates, key=lambda b, r=r: own_score(v[r][b], costs.round_cost(c, b))) for r in range(c)]
        weighed = [[b] * c for b in policy.candidates] + [own]
        best = max(_plan_score(p, v, costs, rho) for p in weighed)
        assert _plan_score(chosen, v, costs, rho) == pytest.approx(best), trial
        mixed += len(set(chosen)) > 1
    assert 0 < mixed < 20  # both kinds of plan won somewhere


def test_profile_times_block_sizes_in_turn(model, monkeypatch):
    """Within one C each pass times every part of every block size once, so a slow spell of the machine
    lands on all block sizes alike; each part keeps the median of its passes after the warm-up pass."""
    import recguide_hf.tools.profile as profile

    calls, fake = [], {}

    def timer(key, seconds):
        def once():
            calls.append(key)
            fake[key] = fake.get(key, 0) + 1
            return seconds[fake[key] - 1]
        return once

    # pass 0 (warm-up) reads 9 s; then B=4's draft reads 1, 2, 30 s (median 2)
    monkeypatch.setattr(profile, "_forward_timer", lambda bb, cache, rows, q, intra, draft_from=None, forward=None:
                        timer((rows.numel(), q, draft_from), [9.0, 1.0, 2.0, 30.0]))
    monkeypatch.setattr(profile, "_host_timer", lambda bb, c, b: timer((c, "host", b), [9.0, 0.1, 0.1, 0.1]))
    table = profile.profile_costs(model, concurrencies=(1, 2), block_sizes=(1, 4), prefix_len=8, repeats=3)
    per_pass = 1 + 1 + 1 + 4 + 1  # B=1: step, host; B=4: draft, 4 verify shapes, host
    assert len(calls) == 2 * 4 * per_pass
    for c in (1, 2):
        c_calls = [k for k in calls if k[0] == c]
        passes = [c_calls[i * per_pass:(i + 1) * per_pass] for i in range(4)]
        assert all(p == passes[0] for p in passes) and len(set(passes[0])) == per_pass
        assert table["costs"][str(c)]["4"]["draft"] == 2.0 and table["costs"][str(c)]["1"]["host"] == 0.1


def test_online_costs_move_off_a_block_the_table_underpriced():
    """The table says a plain step costs 4 ms, so the unsure request takes B = 1 (250 tokens a second; B = 8:
    150). Rounds measured at the table's price for B = 8 and at 5x it for B = 1 make the policy draft again: B = 1
    is dearer than the table said RELATIVE to B = 8. A few rounds do not flip the plan, a price common to every
    block size moves nothing, a size not measured yet reads up to 10% cheaper (optimism 0.1 and a prior of 16
    rounds, set here; the optimism fades as the size is measured), and with `recguide_online_costs=False`
    nothing moves at all."""
    costs, values = _tables(flat_cost=True, step=0.004)
    config = DecodingConfig(block_size="auto", online_optimism=0.1, online_prior=16)
    optimism, prior = config.online_optimism, config.online_prior
    policy = BlockPolicy(config, costs, values)
    fixed = BlockPolicy(DecodingConfig(block_size="auto", online_costs=False), costs, values)
    policy.start(8), fixed.start(8)
    assert policy.online and not fixed.online
    assert choose(policy, 8, -3.0, 8, False) == 1
    for _ in range(60):  # the machine is 3x slower than the table everywhere: no block is cheaper than before
        policy.observe(_timed(8, 1, 3 * 0.004))
        policy.observe(_timed(8, 8, 3 * 0.02))
    w = 60 / (60 + prior)
    assert policy.factor(1) == pytest.approx(3.0 * math.exp(-(1 - w) * optimism)) == policy.factor(8)
    assert policy.factor(16) == pytest.approx(3.0 * math.exp(-optimism))  # never run: optimism
    assert choose(policy, 8, -3.0, 8, False) == 1
    policy = BlockPolicy(config, costs, values)
    policy.start(8)
    for _ in range(2):
        for p in (policy, fixed):
            p.observe(_timed(8, 1, 0.02))
            p.observe(_timed(8, 8, 0.02))
    assert policy.factor(1) > policy.factor(8) and choose(policy, 8, -3.0, 8, False) == 1
    for _ in range(60):
        for p in (policy, fixed):
            p.observe(_timed(8, 1, 0.02))
            p.observe(_timed(8, 8, 0.02))
    assert 3.0 < policy.factor(1) / policy.factor(8) < 5.0  # 5x, shrunk toward the table by 16 rounds
    assert choose(policy, 8, -3.0, 8, False) > 1
    assert fixed.factor(1) == fixed.factor(8) == 1.0 and choose(fixed, 8, -3.0, 8, False) == 1
    for _ in range(200):  # plain steps get cheap again: the price follows
        policy.observe(_timed(8, 1, 0.004))
        policy.observe(_timed(8, 8, 0.02))
    assert policy.factor(1) / policy.factor(8) == pytest.approx(1.0, abs=0.05)
    assert choose(policy, 8, -3.0, 8, False) == 1


def test_a_near_tie_the_table_has_not_measured_gets_tried():
    """Serving found B = 4 faster than the table said, relative to B = 1 (C = 16 in the bench). With only
    B = 1 measured, every size moves with the common factor, but a size within the optimism of the best is
    tried (its price reads up to 10% cheaper until measured), and once measured it stays if it really is
    faster; a size the table prices far worse is never tried."""
    costs = {}
    for c in (1, 16):
        costs[str(c)] = {"1": {"draft": 0.0, "verify": [0.0262] * 4},  # 16 / 26.2 ms = 611 tokens/s
                         "4": {"draft": 0.0413, "verify": [0.0414] * 4},  # 16 x 3.1 / 82.7 ms = 600 tokens/s
                         "32": {"draft": 0.2, "verify": [0.2] * 4}}
    values = ValueTable({"block_sizes": [4, 32], "s_edges": [], "mean": {"4": 3.1, "32": 5.35},
                         "values": {"4": {}, "32": {}}, "shrink": {"4": 0.0, "32": 0.0}})
    policy = BlockPolicy(DecodingConfig(block_size="auto", online_optimism=0.1, online_prior=16),
                         CostTable({"costs": costs}), values)
    assert choose(policy, 16, -3.0, 4, False) == 1  # the table's best by 2%
    plain, four = CostTable({"costs": costs}).round_cost(16, 1), CostTable({"costs": costs}).round_cost(16, 4)
    picks = []
    for _ in range(100):
        b = choose(policy, 16, -3.0, 4, False)
        picks.append(b)
        # plain steps 20% dearer than the table; B = 4 accepts what the value table says (3.1 tokens a round)
        policy.observe(_timed(16, b, 1.2 * plain if b == 1 else four, accepted=0.0 if b == 1 else 2.1))
    assert 4 in picks[:5] and 32 not in picks
    # B = 4 from then on, with B = 1 re-checked now and then, less and less often as its price is measured
    assert picks[50:].count(4) >= 0.85 * 50 and picks[:50].count(1) > picks[50:].count(1)


def test_online_values_follow_the_acceptance_the_call_observes():
    """The value table says B = 4 accepts 2 drafts a round (3 tokens for twice a plain step's price: the best
    plan); these prompts accept 0.5. Rounds priced as the table says (so only the values can move the plan) make
    the policy fall back to plain steps within a few rounds; B = 8, never run, reads the same ratio; the
    correction is shrunk toward the table (a round or two moves little); with `recguide_online_values=False`
    the table alone decides. Prompts that accept as predicted leave the plan where it was."""
    costs = CostTable({"costs": {str(c): {"1": {"draft": 0.0, "verify": [0.010 * c / 8] * 4},
                                          "4": {"draft": 0.010 * c / 8, "verify": [0.010 * c / 8] * 4},
                                          "8": {"draft": 0.020 * c / 8, "verify": [0.020 * c / 8] * 4}}
                                 for c in (1, 8)}})
    values = ValueTable({"block_sizes": [4, 8], "s_edges": [], "mean": {"4": 3.0, "8": 5.0},
                         "values": {"4": {}, "8": {}}, "shrink": {"4": 0.0, "8": 0.0}})
    hard = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    table_only = BlockPolicy(DecodingConfig(block_size="auto", online_values=False), costs, values)
    easy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    assert hard.learns_values and not table_only.learns_values
    picks = {id(p): [] for p in (hard, table_only, easy)}
    for _ in range(12):
        for p, accepted in ((hard, 0.5), (table_only, 0.5), (easy, 2.0)):
            b = choose(p, 8, -3.0, 4, False)
            picks[id(p)].append(b)
            p.observe(_timed(8, b, costs.round_cost(8, b), accepted=0.0 if b == 1 else accepted))
    assert picks[id(hard)][0] == 4 and picks[id(hard)][-6:] == [1] * 6 and 4 in picks[id(hard)][:3]
    assert picks[id(table_only)] == [4] * 12 and picks[id(easy)] == [4] * 12
    assert 0.25 < hard.value_scale(4) < 0.5  # 0.5 / 2 observed, shrunk toward 1 by VALUE_PRIOR drafts
    assert hard.value_scale(8) == hard.value_scale(4)  # one ratio for every size (policy.py: "online values")
    assert easy.value_scale(4) == pytest.approx(1.0) and table_only.value_scale(4) == 1.0
    assert hard.value_scale(1) == 1.0  # a plain step always yields one token


def test_the_engine_feeds_the_acceptance_it_meets_to_the_policy():
    """An engine whose drafts are always wrong (MockBackbone: the draft tokens differ from the true text): the
    table promises 3 tokens a round at B = 4 for twice a plain step's price, so the first round drafts; every
    round of B = 4 reports what it predicted and what was accepted (0), and the policy falls back to plain steps.
    With `recguide_online_values=False` it keeps drafting (one token a round, V_4 = 3 by the table) but for its last
    few tokens, where a round is worth only what the request may still emit (`_to_the_limit`): 5 left takes a plain
    step (B = 4 would leave 2, short of a steady round, and its 3 tokens less that leftover's extra round make 50
    a second, as a plain step does: a tie goes to the smaller block), 4, 3 and 2 left B = 4 rounds (by the table
    they finish or leave one token; the drafts are wrong, so each makes one), 1 left a plain step. Both emit the
    true text."""
    true = [10 + i for i in range(200)]
    costs = CostTable({"costs": {str(c): {"1": {"draft": 0.0, "verify": [0.010 * c] * 4},
                                          "4": {"draft": 0.010 * c, "verify": [0.010 * c] * 4}} for c in (1, 8)}})
    values = ValueTable({"block_sizes": [4], "s_edges": [], "mean": {"4": 3.0}, "values": {"4": {}},
                         "shrink": {"4": 0.0}})
    mix = {}
    for learns in (True, False):
        config = DecodingConfig(mode="linear", block_size="auto", online_values=learns, online_costs=False)
        policy = BlockPolicy(config, costs, values)
        engine = Engine(MockBackbone(true, [5] * 200), config, SamplingSettings(max_new_tokens=24), policy=policy)
        seq, stats = engine.generate(torch.tensor([true[:3]] * 2))
        assert seq[:, 3:].tolist() == [true[3:27]] * 2
        mix[learns] = stats.as_dict()["block_sizes"]
        if learns:
            assert policy.value_scale(4) < 0.6 and policy.prices.values.made == 0.0
            assert policy.prices.values.expected > 0
    assert mix[False] == {4: 2 * 22, 1: 2 * 2}
    # B = 4 makes V'_4 = 1 + 2a tokens in twice a plain step's time: it pays while a > 1/2, which VALUE_PRIOR's 16
    # drafts of the table's word hold for four rounds of 2 rows (a = 16 / (16 + 4 x rounds)); then plain steps
    assert mix[True].get(4, 0) <= 2 * 5 and mix[True][1] >= 2 * 19


def test_the_engine_reports_each_buckets_round_time(model):
    """Under "auto" the engine hands the policy one measured time per bucket round, for the rows and block
    size of that bucket; greedy output is still plain greedy."""
    costs, values = _tables(flat_cost=True, step=0.006)
    cfg = DecodingConfig(mode="linear", block_size="auto")
    seen = []

    class Recording(BlockPolicy):
        def observe(self, out):
            seen.append((out.rows.numel(), out.block, out.seconds))
            super().observe(out)

    policy = Recording(cfg, costs, values)
    ids, mask = left_pad(random_prompts(3, 96, min_len=2, max_len=9, seed=4))
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    engine = Engine(as_backbone(model), cfg, SamplingSettings(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=PAD),
                    policy=policy)
    out, stats = engine.generate(ids, mask)
    assert torch.equal(out, ref[:, :out.shape[1]])
    assert len(seen) >= stats.as_dict()["rounds"] / 3 and all(s > 0 and b in policy.candidates for _, b, s in seen)
    assert sum(n for n, _, _ in seen) == stats.as_dict()["rounds"]  # every row's round is in exactly one bucket
    assert set(policy.prices.seen) == {b for _, b, _ in seen}




def test_generate_keeps_measured_prices_across_calls(model, tmp_path):
    """`generate` under "auto" keeps the online prices on the model, one per cost table, so the rounds of
    earlier calls count in later ones; a fixed block size measures nothing."""
    import json

    import recguide_hf

    costs, values = _tables(flat_cost=True, step=0.006)
    (tmp_path / "costs.json").write_text(json.dumps(costs.data))
    (tmp_path / "values.json").write_text(json.dumps(values.data))
    cost_path = str(tmp_path / "costs.json")
    ids, mask = left_pad(random_prompts(2, 96, min_len=2, max_len=9, seed=3))
    kw = dict(recguide_mode="linear", recguide_block_size="auto", recguide_cost_table=cost_path,
              recguide_value_table=str(tmp_path / "values.json"), max_new_tokens=10)
    model.__dict__.pop("_recguide_prices", None)
    recguide_hf.generate(model, ids, attention_mask=mask, **kw)
    prices = model._recguide_prices[cost_path]
    first = prices.rounds
    assert first > 0
    recguide_hf.generate(model, ids, attention_mask=mask, **kw)
    assert model._recguide_prices[cost_path] is prices and prices.rounds > first
    second = prices.rounds
    recguide_hf.generate(model, ids, attention_mask=mask, **{**kw, "recguide_block_size": 4})
    assert prices.rounds == second
    model.__dict__.pop("_recguide_prices")


def test_accepted_signal_fit_known_answer():
    """s_t from recent verification outcomes: requests that keep accepting 20 drafts and requests that accept
    2 have the SAME entropy here, so only the accepted signal tells them apart. A round's previous outcomes
    are read as a round at the state's block would have seen them (censored at B' - 1); 0 after a plain step."""
    from recguide_hf.core.calibrate import accepted_signal

    nan = float("nan")
    s = [accepted_signal(n1, n2, b) for n1, n2, b in [(20.0, 2.0, 8), (20.0, 20.0, 32), (5.0, 5.0, 1), (3.0, nan, 8),
                                                       (nan, 1.0, 8), (nan, 1.0, 1)]]
    assert s[:4] == [(7 + 2) / 2, 20.0, 0.0, 3.0] and math.isnan(s[4])  # n2 NaN reads n1; n1 NaN: NaN
    assert s[5] == 0.0  # after a plain step, whatever came before
    rounds = [Round("a", req, t, 1.0, 20 if req % 2 == 0 else 2) for req in range(40) for t in range(6)]
    table = fit(rounds, block_sizes=(1, 8, 32), num_bins=4, signal="accepted")
    vt = ValueTable(table)
    assert vt.signal == "accepted" and table["signal"] == "accepted"
    assert vt.value(32, 20.0, 32, False) == pytest.approx(21) and vt.value(32, 2.0, 32, False) == pytest.approx(3)
    # out of fold it predicts (perfectly in the states after a block; a plain step's state carries no signal)
    assert table["report"]["rmse"]["32"] < 0.8 * table["report"]["rmse_constant"]["32"]
    entropy = ValueTable(fit(rounds, block_sizes=(1, 8, 32), num_bins=2))
    assert entropy.signal == "entropy" and entropy.value(32, -1.0, 32, False) == pytest.approx(entropy.mean[32])
    with pytest.raises(ValueError, match="signal"):
        fit(rounds, signal="margin")


def test_first_rounds_are_calibrated_apart():
    """A request's first round (right after its prompt) accepts fewer drafts than later ones: here 1 against 20.
    The table keeps their mean apart (`first`) and reads it for a slot with no round yet (prev_block 0), the
    state-and-signal values for the rest; a table from before `first` existed reads the block's mean there."""
    rounds = [Round("a", req, t, 1.0, 1 if t == 0 else 20) for req in range(20) for t in range(5)]
    table = fit(rounds, block_sizes=(1, 8, 32), num_bins=2, signal="accepted")
    assert table["first"] == {"1": 1.0, "8": 2.0, "32": 2.0}
    assert table["mean"]["32"] == pytest.approx(21.0)  # every round with history accepted 20
    values = ValueTable(table)
    v = values.values_matrix([8, 32], torch.tensor([float("nan"), 20.0]), torch.tensor([0, 32]),
                             torch.tensor([False, False]))
    assert v[0].tolist() == pytest.approx([2.0, 2.0]) and v[1].tolist() == pytest.approx([8.0, 21.0])
    assert values.value(32, None, None, None) == pytest.approx(2.0) == values.value(32, None, 0, False)
    legacy = ValueTable({k: x for k, x in table.items() if k != "first"})
    assert legacy.value(32, None, None, None) == pytest.approx(21.0)
    assert legacy.values_matrix([32], torch.tensor([float("nan")]), torch.tensor([0]),
                                torch.tensor([False])).item() == pytest.approx(21.0)


def test_a_static_batch_waits_on_its_unluckiest_request():
    """A round's progress strays sigma_B from what the table predicts (its out-of-fold RMSE), so of c requests the
    slowest makes n rounds' tokens about z_c sigma_B sqrt(n) short of n V_B (z_c: the mean largest of c standard
    normals). Here every request makes V_8 = 5 tokens a round at 4 x a plain step's price (125 tokens a second
    against 100): a request at the mean finishes its 40 tokens in 8 rounds (32 plain steps' time, against 40), but
    with sigma_8 = 2.5 the slowest of 16 needs sqrt(n) = (z 2.5 + sqrt((z 2.5)^2 + 800)) / 10, n = 10.9 rounds (43.7
    plain steps' time): plain steps finish the batch sooner. One request keeps the rate rule; a table without a
    measured spread plans for the mean (B = 8)."""
    assert _largest_of(16) == pytest.approx(1.766, abs=0.01) and _largest_of(2) == pytest.approx(0.564, abs=0.03)
    assert _rounds_to_make(40, 5.0, 0.0) == 8.0 and _rounds_to_make(3, 1.0, 0.0) == 3.0
    assert _rounds_to_make(40, 5.0, _largest_of(16) * 2.5) == pytest.approx(10.9, abs=0.1)
    costs = CostTable({"costs": {str(c): {"1": {"draft": 0.0, "verify": [0.01] * 4},
                                          "8": {"draft": 0.02, "verify": [0.02] * 4}} for c in (1, 16)}})

    def planned(rows, rmse):
        values = ValueTable({"block_sizes": [8], "s_edges": [], "mean": {"8": 5.0}, "values": {"8": {}},
                             "shrink": {"8": 0.0}, "first": {"8": 5.0}, "report": {"rmse": {"8": rmse}}})
        policy = BlockPolicy(DecodingConfig(block_size="auto", online_costs=False, online_values=False), costs, values)
        policy.start(rows)
        policy.whole_batch = True  # as Engine.generate sets it
        return policy.plan(torch.arange(rows), torch.zeros(rows, dtype=torch.bool), torch.full((rows,), 40)).tolist()

    assert planned(16, rmse=2.5) == [1] * 16
    assert planned(16, rmse=0.0) == [8] * 16
    assert planned(1, rmse=2.5) == [8]


def test_policy_reads_recent_acceptance_and_skips_the_entropy_pass(model):
    """With a table fitted on the accepted signal, the plan follows each request's recent acceptance (no
    history: the block's mean) and the engine computes no verifier entropy."""
    rounds = [Round("a", req, t, 1.0, 20 if req % 2 == 0 else 2) for req in range(40) for t in range(6)]
    values = ValueTable(fit(rounds, block_sizes=(1, 8, 32), num_bins=4, signal="accepted"))
    costs, _ = _tables(flat_cost=True, blocks=(1, 8, 32), step=0.006)
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)
    assert not policy.reads_entropy
    policy.start(3)
    stats = policy.signals
    stats.last_block[:] = 32
    stats.last_accepted[0] = torch.tensor([20.0, 20.0])  # keeps accepting: long blocks
    stats.last_accepted[1] = torch.tensor([2.0, 2.0])  # 3 tokens a round: a plain step is cheaper here
    stats.last_accepted[2] = float("nan")  # no history
    stats.last_block[2] = 0
    stats.entropy[:] = 5.0  # would read as unsure for everyone if the entropy were the signal
    planned = [int(policy.plan(torch.tensor([r]), torch.zeros(3, dtype=torch.bool))[0]) for r in range(3)]
    assert planned[:2] == [32, 1]
    assert planned[2] == max(policy.candidates, key=lambda b: values.mean[b] / costs.round_cost(1, b))
    stats.record(RoundOutcome(torch.tensor([0]), 8, torch.tensor([3]), torch.tensor([7])))
    assert stats.last_accepted[0].tolist() == [3.0, 20.0]
    stats.record(RoundOutcome(torch.tensor([0]), 1, torch.tensor([0]), torch.tensor([0])))
    assert math.isnan(stats.last_accepted[0, 0]) and stats.last_accepted[0, 1] == 3.0  # a plain step drafted nothing
    stats.last_block[0] = 1
    assert int(policy.plan(torch.tensor([0]), torch.zeros(3, dtype=torch.bool))[0]) == 32  # s = 0 after it
    engine = Engine(as_backbone(model), DecodingConfig(block_size="auto"), SamplingSettings(max_new_tokens=8),
                    policy=policy)
    assert not engine.wants_entropy


def test_a_static_batch_is_planned_for_its_slowest_request():
    """One static batch (`generate`) returns when its last request is done. A confident request (V_32 = 21)
    beside an unsure one (3 tokens a round at any block) with as many tokens to go: by tokens per second a
    round of 32 is best (24 tokens where 8 makes 11, at prices that grow slowly with B), but the batch waits on
    the unsure request, which every block gives 3 tokens: the cheapest block finishes the batch soonest. A
    server's slots (a freed slot takes the next request) keep the rate rule; a lone request has no laggard."""
    values = ValueTable(fit(_synthetic_rounds(), block_sizes=(8, 16, 32), num_bins=2))
    costs = _costs(fixed=0.02, per_row=0.0, per_token=1e-5, blocks=(8, 16, 32))
    policy = BlockPolicy(DecodingConfig(block_size="auto"), costs, values)

    def planned(whole_batch, rows=2):
        policy.start(rows)
        policy.whole_batch = whole_batch  # as Engine.generate sets it
        policy.signals.entropy[:] = torch.tensor([0.1, 3.0][:rows])[:, None]
        policy.signals.last_block[:] = torch.tensor([32, 8][:rows])
        policy.signals.last_full[:] = torch.tensor([False, False][:rows])
        return policy.plan(torch.arange(rows), torch.zeros(rows, dtype=torch.bool), torch.full((rows,), 40)).tolist()

    assert values.value(32, -0.1, 32, False) == pytest.approx(21)
    assert values.value(8, -3.0, 8, False) == pytest.approx(3) == values.value(32, -3.0, 8, False)
    assert planned(whole_batch=False) == [32, 32]
    assert planned(whole_batch=True) == [8, 8]
    assert planned(whole_batch=True, rows=1) == planned(whole_batch=False, rows=1) == [32]


def test_generate_plans_its_batch_as_one_and_a_server_does_not(model):
    """`Engine.generate` tells the policy its rows are one static batch; `open` (a server's slots: a freed slot
    takes the next request) does not; `serve` does once its last prompt is admitted (test_engine.py has the steps)."""
    config = DecodingConfig(mode="linear", block_size=4)
    settings = SamplingSettings(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=PAD)
    prompts = random_prompts(2, 96, min_len=2, max_len=6, seed=3)
    engine = Engine(as_backbone(model), config, settings)
    engine.generate(*left_pad(prompts))
    assert engine.policy.whole_batch
    engine.open(2, 8)
    assert not engine.policy.whole_batch
    engine.serve(prompts, slots=2)  # both prompts admitted at once: one static batch from the first step
    assert engine.policy.whole_batch


@pytest.mark.parametrize("first_draft", ["mask", "verifier"])
def test_the_value_table_is_calibrated_with_the_folders_draft_layout(model, monkeypatch, first_draft):
    """`calibrate_table` (and so `recguide distill`'s tables step) drafts as the folder will decode: with its
    `recguide_first_draft`, whose acceptance differs (a verifier-made d_1 is always accepted at greedy)."""
    from recguide_hf.tools import profile

    seen = []

    class Recording(profile.Engine):
        def __init__(self, backbone, config, *args, **kwargs):
            seen.append(config.first_draft)
            super().__init__(backbone, config, *args, **kwargs)

    monkeypatch.setattr(profile, "Engine", Recording)
    model.generation_config.recguide_first_draft = first_draft
    try:
        table = profile.calibrate_table(model, {"s": random_prompts(3, 96, min_len=2, max_len=9, seed=8)},
                                        block_sizes=(1, 4), max_new_tokens=8, pad_token_id=PAD)
    finally:
        del model.generation_config.recguide_first_draft
    assert seen == [first_draft] and table
