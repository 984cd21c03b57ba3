"""The open-loop measurement: seeded traces, the replay on a simulated clock, and the latency figures."""

import json
import types

import pytest
import torch
from conftest import EOS, PAD, random_prompts, tiny_model

from recguide_hf.tools.bench import VirtualCosts
from recguide_hf.tools.openloop import (
    Timed,
    bursty_rate,
    bursty_trace,
    parse_arrivals,
    poisson_trace,
    run_engine_open,
    summarize_open,
)


def test_poisson_trace_is_seeded_and_has_its_rate():
    a, b = poisson_trace(5.0, 4000, seed=3), poisson_trace(5.0, 4000, seed=3)
    assert a == b and a != poisson_trace(5.0, 4000, seed=4)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / len(a) == pytest.approx(1 / 5.0, rel=0.05)


def test_bursty_trace_swings_low_high_low():
    low, high, seconds = 2.0, 64.0, 400.0
    trace = bursty_trace(low, high, seconds, seed=1)
    assert trace == bursty_trace(low, high, seconds, seed=1)
    per = lambda a, b: sum(a * seconds <= t < b * seconds for t in trace) / ((b - a) * seconds)  # noqa: E731
    assert per(0, 0.25) == pytest.approx(low, rel=0.25) and per(0.75, 1) == pytest.approx(low, rel=0.25)
    assert per(0.375, 0.625) == pytest.approx(high, rel=0.1)
    assert bursty_rate(0.3125 * seconds, low, high, seconds) == pytest.approx((low * high) ** 0.5)  # geometric


@pytest.mark.parametrize("bad", ["poisson:0,10", "poisson:5", "bursty:5,2,10", "bursty:1,2", "gamma:1,2",
                                 "poisson:x,1"])
def test_bad_arrival_specs_say_what_is_expected(bad):
    with pytest.raises(ValueError, match="poisson:RATE,N or bursty:LOW,HIGH,SECONDS"):
        parse_arrivals(bad)


def test_figures_by_hand():
    reqs = [Timed(0.0, 0, [(0.5, 1), (0.7, 3), (1.5, 2)], [1, 2, 3, 4, 5, 6], 1.5),
            Timed(1.0, 1, [(1.2, 1)], [7], 1.2)]
    out = summarize_open({"requests": reqs, "timeline": [(0.5, 1, {8: 1}), (0.7, 1, {8: 1}), (1.5, 2, {1: 2})]},
                         reference=[[1, 2, 3, 4, 5, 6], [7]])
    assert out["output_tps"] == pytest.approx(7 / 1.5)
    assert (out["ttft_p50"], out["ttft_p99"]) == (pytest.approx(0.2), pytest.approx(0.5))
    assert out["tpot_p50"] == pytest.approx(1.0 / 5)  # one multi-token request: (1.5 - 0.5) / 5
    assert out["decode_speed_mean"] == pytest.approx(6 / 1.0)  # the 1-token request has no span
    assert out["itl_chunk_p99"] == pytest.approx(0.8)
    assert sorted(out["block_mix"].items()) == [(1, 0.5), (8, 0.5)] and out["equal_to_ar"]
    assert out["max_in_flight"] == 2


def test_replay_on_a_simulated_clock_equals_greedy(tmp_path):
    """Requests arriving by a trace, priced by a cost model: every request's tokens = HF greedy, the clock is the
    model's (an idle engine jumps to the next arrival), and latencies are positive."""
    model = tiny_model(seed=3)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"name": "test", "published_round_ms": {"1": {"4": 10.0}, "16": {"4": 40.0}}}))
    virtual = VirtualCosts(costs)
    pool = random_prompts(5, 96, min_len=2, max_len=9, seed=2)
    arrivals = [0.0, 0.001, 0.002, 5.0, 5.0005, 9.0]  # a burst, a gap, a pair, a straggler
    tok = types.SimpleNamespace(pad_token_id=PAD)
    run = run_engine_open(model, tok, pool, arrivals, 12, "linear-4", slots=2, virtual=virtual)
    reference = []
    for p in pool:
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        reference.append(ref[: ref.index(EOS) + 1] if EOS in ref else ref)
    out = summarize_open(run, reference)
    assert out["equal_to_ar"] and out["finished"] == 6
    assert out["max_in_flight"] == 3  # the burst: two rows and one waiting
    assert all(r.chunks[0][0] > r.arrival for r in run["requests"])
    assert run["requests"][3].chunks[0][0] < 5.5  # after the gap the clock jumped to 5.0, not past it
    assert run["timeline"][-1][0] > 9.0
