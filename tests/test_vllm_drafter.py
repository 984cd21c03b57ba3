"""The vLLM proposer's draft step (`integrations/vllm/drafter.py`) without vLLM: driven by a verifier loop here that
accepts what HF greedy would, it must draft what the engine drafts (same layout, same adapter routing) round for
round, whatever order the requests come in, and RecGuide's per-request blocks must stay within what vLLM takes."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EOS, PAD, random_prompts

pytest.importorskip("peft")

from test_draft_adapter import with_adapter

import recguide_hf
import recguide_hf.models.modeling
from recguide_hf.core import engine as engine_module
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.draft import make_draft
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.core.masks import left_pad
from recguide_hf.integrations.vllm import ARCHITECTURES, speculative_config
from recguide_hf.integrations.vllm.drafter import ShadowDrafter
from recguide_hf.models.registry import as_backbone

NEW = 24


def engine_rounds(model, prompts, config, monkeypatch=None):
    """Per prompt (decoded alone): the engine's output, the drafts accepted in each of its rounds and (with
    `monkeypatch`) the draft tokens of each round."""
    settings = SamplingSettings(max_new_tokens=NEW, eos_token_ids=[EOS], pad_token_id=PAD)
    outs, rounds, drafted = [], [], []
    for prompt in prompts:
        seen = []
        if monkeypatch is not None:
            def recording(*args, seen=seen, **kwargs):
                block = make_draft(*args, **kwargs)
                seen.append(block.ids[0].tolist())
                return block

            monkeypatch.setattr(engine_module, "make_draft", recording)
        ids, attn = left_pad([prompt], PAD)
        seqs, stats = Engine(as_backbone(model), config, settings).generate(ids, attn, log_rounds=True)
        outs.append(seqs[0, ids.shape[1]:ids.shape[1] + int(stats.new_tokens[0])].tolist())
        rounds.append([(n, k) for _, _, n, k, _, _ in stats.round_log])
        drafted.append(seen)
    return outs, rounds, drafted


def full_rounds(rounds, drafts):
    """The drafts accepted in a request's rounds until the first one its token limit cut short (that round drafts
    fewer masks: another forward)."""
    kept = []
    for n, k in rounds:
        if k < drafts:
            break
        kept.append(n)
    return kept


def verify_with(drafter, prompts, outputs, shuffle=None):
    """A verifier that knows each request's greedy output: every step it takes the drafts, accepts their prefix that
    equals the output and appends one token more, as vLLM's greedy rejection sampler does. Returns the drafts
    accepted per round of each request, and the drafts' lengths."""
    tokens = [list(p) for p in prompts]
    made = [0] * len(prompts)
    accepted: list[list[int]] = [[] for _ in prompts]
    proposals: list[list[list[int]]] = [[] for _ in prompts]
    lengths: list[int] = []
    g = np.random.default_rng(0)
    for _ in range(4 * NEW):
        live = [i for i in range(len(prompts)) if made[i] < len(outputs[i])]
        if not live:
            break
        order = list(g.permutation(live)) if shuffle else live
        drafts = drafter.step([np.array(tokens[i], dtype=np.int64) for i in order])
        for i, d in zip(order, drafts):
            ref = outputs[i][made[i]:]
            n = 0
            while n < min(len(d), len(ref) - 1) and d[n] == ref[n]:
                n += 1
            if d:
                accepted[i].append(n)
                proposals[i].append(list(d))
                lengths.append(len(d))
            tokens[i] += ref[:n + 1]
            made[i] += n + 1
    return accepted, lengths, proposals


@pytest.mark.parametrize("first_draft", ["mask", "verifier"])
def test_drafts_are_the_engines_round_for_round(first_draft, monkeypatch):
    model = with_adapter(0)  # a random LoRA: routing it to the wrong tokens would change the drafts
    prompts = random_prompts(5, model.config.vocab_size, min_len=3, max_len=11, seed=3)
    config = DecodingConfig(mode="linear", block_size=4, first_draft=first_draft)
    outs, rounds, drafted = engine_rounds(model, prompts, config, monkeypatch)
    expected = [full_rounds(r, 3) for r in rounds]
    assert sum(map(len, expected)) >= 10
    if first_draft == "verifier":  # d_1 is the verifier's own token: accepted every full round, even at random
        assert all(n >= 1 for e in expected for n in e)
    for shuffle in (False, True):  # all requests in each step, in one order, then in a new order every step
        drafter = ShadowDrafter(model, config, slots=8, max_drafts=3, capacity=64)
        accepted, lengths, proposals = verify_with(drafter, prompts, outs, shuffle=shuffle)
        assert [a[: len(e)] for a, e in zip(accepted, expected)] == expected
        assert [p[: len(e)] for p, e in zip(proposals, expected)] == [d[: len(e)] for d, e in zip(drafted, expected)]
        assert set(lengths) == {3}


def test_rows_are_freed_and_reused_and_report_their_requests():
    model = with_adapter(1)
    config = DecodingConfig(mode="linear", block_size=4, first_draft="verifier")
    prompts = random_prompts(3, model.config.vocab_size, min_len=3, max_len=8, seed=5)
    outs, rounds, _ = engine_rounds(model, prompts, config)
    drafter = ShadowDrafter(model, config, slots=2, max_drafts=3, capacity=64)
    for k in range(3):  # two rows, three requests one at a time: each row freed when its request leaves
        accepted, _, _ = verify_with(drafter, [prompts[k]], [outs[k]])
        expected = full_rounds(rounds[k], 3)
        assert accepted[0][: len(expected)] == expected
    drafter.step([])  # no request: the last one's row is freed too
    done = drafter.take_finished()
    assert len(done) == 3 and all(s.rounds > 0 and s.tau >= 1 for s in done)
    with pytest.raises(RuntimeError, match="rows"):
        drafter.step([np.array(p, dtype=np.int64) for p in prompts])


def test_recguide_auto_blocks_per_request_within_vllms_drafts():
    folder = Path(recguide_hf.__file__).parent / "bundled" / "recguide-tiny"
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    config = DecodingConfig.from_sources(GenerationConfig.from_pretrained(folder))
    assert config.mode == "recguide" and config.block_size == "auto"
    prompts = random_prompts(4, model.config.vocab_size, min_len=4, max_len=10, seed=7)
    ar = DecodingConfig(mode="linear", block_size=1)
    outs, _, _ = engine_rounds(model, prompts, ar)
    drafter = ShadowDrafter(model, config, slots=4, max_drafts=7, capacity=128, base_dir=folder)
    assert drafter.policy is not None and max(drafter.policy.candidates) <= 8
    accepted, lengths, _ = verify_with(drafter, prompts, outs)
    assert lengths and max(lengths) <= 7 and all(n + 1 in drafter.policy.candidates for n in lengths)
    assert sum(map(sum, accepted)) > 0  # the bundled model's drafts are accepted


def test_plugin_names_what_vllm_loads():
    spec = speculative_config(7)
    assert spec["method"] == "custom_class" and spec["num_speculative_tokens"] == 7
    module, name = spec["model"].rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name).__name__ == name
    assert set(ARCHITECTURES) == {cls.__name__ for cls in recguide_hf.models.modeling.SELF_SPECULATIVE.values()}


def test_plain_steps_run_no_forward_of_the_drafters_own():
    model = with_adapter(2)
    drafter = ShadowDrafter(model, DecodingConfig(mode="ar"), slots=2, max_drafts=3, capacity=64)
    calls = []
    forward = drafter.backbone.forward
    drafter.backbone.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    prompts = random_prompts(2, model.config.vocab_size, min_len=3, max_len=8, seed=9)
    for step in range(3):
        assert drafter.step([np.array(p + [5] * step, dtype=np.int64) for p in prompts]) == [[], []]
    assert calls == []  # B = 1: vLLM's own step is all there is


def arr(tokens):
    return np.array(tokens, dtype=np.int64)


def test_plain_steps_keep_their_row():
    model = with_adapter(2)
    drafter = ShadowDrafter(model, DecodingConfig(mode="ar"), slots=2, max_drafts=3, capacity=64)
    prompt = random_prompts(1, model.config.vocab_size, min_len=1, max_len=1, seed=4)[0]  # one token
    for step in range(3):
        drafter.step([arr(prompt + [5] * step)])
        assert drafter.take_finished() == []  # the same request: its row goes on
    drafter.step([])
    (done,) = drafter.take_finished()
    assert done.plain == 3 and done.rounds == 0


def test_a_request_leaving_frees_its_row_for_one_arriving_in_the_same_step():
    model = with_adapter(3)
    config = DecodingConfig(mode="linear", block_size=4, first_draft="verifier")
    drafter = ShadowDrafter(model, config, slots=2, max_drafts=3, capacity=64)
    a, b, c = random_prompts(3, model.config.vocab_size, min_len=4, max_len=8, seed=6)
    drafter.step([arr(a), arr(b)])
    assert all(len(d) == 3 for d in drafter.step([arr(b + [7]), arr(c)]))  # a left, c came: both rows busy again
    assert len(drafter.take_finished()) == 1


def test_a_follow_up_turn_keeps_the_cache_of_what_it_shares_as_a_new_request():
    model = with_adapter(4)
    config = DecodingConfig(mode="linear", block_size=4, first_draft="verifier")
    drafter = ShadowDrafter(model, config, slots=1, max_drafts=3, capacity=64)
    first = random_prompts(1, model.config.vocab_size, min_len=8, max_len=8, seed=8)[0]
    drafter.step([arr(first)])
    follow_up = first + [9, 10, 11, 12, 13, 14]  # more than one round past what the row saw: another request
    drafts = drafter.step([arr(follow_up)])
    assert len(drafter.take_finished()) == 1 and drafter.stats[0].rounds == 0  # the first request's stats closed
    fresh = ShadowDrafter(model, config, slots=1, max_drafts=3, capacity=64)
    assert drafts == fresh.step([arr(follow_up)])  # the kept cache drafts as a cold start does


def test_rows_catching_up_past_the_cache_width_go_one_by_one():
    model = with_adapter(5)
    config = DecodingConfig(mode="linear", block_size=2, first_draft="verifier")
    drafter = ShadowDrafter(model, config, slots=2, max_drafts=1, capacity=40)
    long, short = random_prompts(2, model.config.vocab_size, min_len=10, max_len=10, seed=2)
    long = long * 3  # 30 tokens
    drafter.step([arr(long), arr(short)])
    # both come back as follow-ups (more than a round on: new requests keeping their caches) in one step: 29 cached
    # + 15 to catch up exceeds the 41 slots of one padded forward
    assert [len(d) for d in drafter.step([arr(long + [5, 6, 7]), arr(short + [7] * 15)])] == [1, 1]
    assert [c.shape[0] for c in drafter.committed] == [32, 24]
