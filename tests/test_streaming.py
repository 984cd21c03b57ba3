"""Tokens as they are decided: HF's streamer protocol through every `generate` entry, and the engine's
requests-as-they-come interface (submit / step / cancel) that a server drives."""

import threading

import pytest
import torch
from conftest import EOS, PAD, random_prompts, tiny_model
from transformers import AutoModelForCausalLM, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import recguide_hf
from recguide_hf import BUNDLED_MODEL
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.models.export import save_model_folder
from recguide_hf.models.hf_backbone import HFBackbone as Backbone


class Recorder(BaseStreamer):
    """HF's streamer protocol, written down: every `put` and how many times `end` was called."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ends += 1


@pytest.fixture(scope="module")
def folder_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream")
    # block 4: a 40-token answer takes several rounds, so "several puts" is a real check
    save_model_folder(tiny_model(seed=2), None, path, recguide_block_size=4)
    return path


@pytest.fixture(scope="module")
def folder(folder_path):
    return AutoModelForCausalLM.from_pretrained(folder_path, trust_remote_code=True)


def ar_new_tokens(model, ids, max_new_tokens):
    out = model.generate(ids, max_new_tokens=max_new_tokens, recguide_mode="ar", do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("entry", ["folder", "package", "custom_generate"])
def test_streamer_gets_prompt_then_each_round_then_end(folder, folder_path, entry):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    s = Recorder()
    if entry == "folder":  # the folder's custom_generate replaces model.generate
        out = folder.generate(ids, max_new_tokens=40, streamer=s)
    elif entry == "package":
        out = recguide_hf.generate(folder, ids, max_new_tokens=40, streamer=s)
    else:  # a plain HF model pointed at the folder's decoding
        plain = tiny_model(seed=2)
        out = plain.generate(ids, max_new_tokens=40, streamer=s, custom_generate=str(folder_path),
                             trust_remote_code=True)
    new = out[0, ids.shape[1]:].tolist()
    assert s.puts[0] == [5, 6, 7, 8, 9]  # the prompt, once, first
    assert s.ends == 1
    assert len(s.puts) >= 3, "tokens arrived in one burst, not round by round"
    assert all(len(p) >= 1 for p in s.puts[1:])
    streamed = [t for p in s.puts[1:] for t in p]
    assert streamed == new[: len(streamed)] and len(streamed) == len(new) - new.count(PAD) * (EOS in new)
    assert new == ar_new_tokens(folder, ids, 40)  # and it is plain greedy's text


def test_text_iterator_streamer_yields_before_generate_returns(folder):
    """The pattern HF's docs teach (and `transformers serve` uses): generate in a thread, read text as it comes.
    The consumer's loop ends by itself (end() is called) and its text is the whole answer."""

    class Tokens:  # a tokenizer stand-in: one "word" per token id
        def decode(self, ids, **kw):
            return "".join(f"<{i}>" for i in ids)

    ids = torch.tensor([[5, 6, 7]])
    streamer = TextIteratorStreamer(Tokens(), skip_prompt=True, timeout=60)
    done = threading.Event()
    result = {}

    def run():
        result["out"] = folder.generate(ids, max_new_tokens=40, streamer=streamer)
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    chunks, before_done = [], 0
    for text in streamer:  # bounded: the streamer's own timeout raises if nothing comes for 60 s
        chunks.append(text)
        before_done += not done.is_set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    new = result["out"][0, 3:].tolist()
    assert "".join(chunks) == "".join(f"<{i}>" for i in new)
    assert before_done >= 1 and len(chunks) >= 2


def test_streamer_end_is_called_when_decoding_fails(folder):
    s = Recorder()
    limit = folder.config.max_position_embeddings
    with pytest.raises(ValueError, match="maximum"):
        recguide_hf.generate(folder, torch.tensor([[5, 6, 7]]), max_new_tokens=limit, streamer=s,
                             recguide_mode="linear")
    assert s.ends == 1


def test_streamer_needs_batch_one_and_still_ends(folder):
    s = Recorder()
    with pytest.raises(ValueError, match="batch of one"):
        folder.generate(torch.tensor([[5, 6], [7, 8]]), max_new_tokens=4, streamer=s)
    assert s.ends == 1


def test_streamer_on_a_model_without_generation_mixin():
    """The direct path (NLD's AutoModel class has no GenerationMixin) streams the same way."""
    from recguide_hf.testing.nld_standin import PAD as NLD_PAD
    from recguide_hf.testing.nld_standin import standin

    model = standin(seed=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    s = Recorder()
    out = recguide_hf.generate(model, ids, max_new_tokens=24, streamer=s, recguide_block_size=4)
    new = out[0, 4:].tolist()
    streamed = [t for p in s.puts[1:] for t in p]
    assert s.puts[0] == [5, 6, 7, 8] and s.ends == 1 and len(s.puts) >= 3
    assert streamed == new[: len(streamed)] and len(streamed) >= len(new) - new.count(NLD_PAD)


# ---------------------------------------------------------------- the engine, requests as they come
def engine_for(model, block=4, max_new=16, mode="linear"):
    return Engine(Backbone(model), DecodingConfig(mode=mode, block_size=block),
                  SamplingSettings(max_new_tokens=max_new, eos_token_ids=[EOS], pad_token_id=PAD))


def solo(model, prompt, max_new):
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    ref = ref[0, len(prompt):].tolist()
    return ref[: ref.index(EOS) + 1] if EOS in ref else ref


def test_requests_arriving_between_rounds_get_their_solo_output(model):
    """Requests submitted while others run, each with its own max_new_tokens, stream HF greedy's tokens."""
    prompts = random_prompts(6, 96, min_len=2, max_len=14, seed=31)
    limits = [16, 5, 12, 1, 16, 9]
    engine = engine_for(model)
    engine.open(slots=3, max_prompt_len=14)
    got = {i: [] for i in range(6)}
    finished, rounds = {}, 0
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 5: [5]}  # round -> requests submitted before it
    while (rounds <= max(arrivals) or engine.num_running or engine.num_waiting) and rounds < 200:
        for i in arrivals.get(rounds, []):
            engine.submit(i, prompts[i], max_new_tokens=limits[i])
        for e in engine.step():
            assert e.request_id not in finished
            got[e.request_id].extend(e.new_ids)
            if e.finished:
                finished[e.request_id] = e.stats
        rounds += 1
    assert sorted(finished) == list(range(6))
    for i, prompt in enumerate(prompts):
        assert got[i] == solo(model, prompt, limits[i]), i
        assert finished[i]["new_tokens"] == len(got[i]) and finished[i]["latency"] > 0


def test_cancel_frees_the_slot_for_the_next_arrival(model):
    prompts = random_prompts(3, 96, min_len=3, max_len=8, seed=5)
    engine = engine_for(model, max_new=40)
    engine.open(slots=1, max_prompt_len=8)
    engine.submit("a", prompts[0])
    engine.submit("b", prompts[1])
    first = engine.step()
    assert [e.request_id for e in first] == ["a"] and engine.num_waiting == 1
    assert engine.cancel("a") and not engine.cancel("a")
    assert engine.num_running == 0
    got = []
    for _ in range(100):
        events = engine.step()
        assert all(e.request_id == "b" for e in events)
        got += [t for e in events for t in e.new_ids]
        if any(e.finished for e in events):
            break
    assert got == solo(model, prompts[1], 40)
    engine.submit("c", prompts[2])
    assert engine.cancel("c") and engine.num_waiting == 0  # a waiting request never starts


def test_submit_refuses_what_does_not_fit(model):
    engine = engine_for(model, max_new=8)
    engine.open(slots=2, max_prompt_len=6)
    with pytest.raises(ValueError, match="1 to 6"):
        engine.submit(1, list(range(5, 12)))
    with pytest.raises(ValueError, match="1 to 6"):
        engine.submit(1, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(1, [5, 6], max_new_tokens=9)
    engine.submit(1, [5, 6], max_new_tokens=0)
    with pytest.raises(ValueError, match="already"):
        engine.submit(1, [5, 6])
    events = engine.step()  # nothing to generate: it finishes at once and frees its slot
    assert [(e.request_id, e.new_ids, e.finished) for e in events] == [(1, [], True)]
    assert engine.num_running == 0


def test_recguide_policy_serves_requests_as_they_come():
    """The auto policy (per-request block sizes, branches) under arrivals, planning with the bundled model's
    tables: still HF greedy per request, whichever sizes it picks."""
    model = tiny_model(seed=4)
    prompts = random_prompts(5, 96, min_len=2, max_len=10, seed=8)
    config = DecodingConfig(mode="recguide", block_size="auto", block_sizes=(1, 2, 4, 8),
                            cost_table=str(BUNDLED_MODEL / "cost_table.json"),
                            value_table=str(BUNDLED_MODEL / "value_table.json"), online_costs=False)
    engine = Engine(Backbone(model), config, SamplingSettings(max_new_tokens=20, eos_token_ids=[EOS], pad_token_id=PAD))
    engine.open(slots=4, max_prompt_len=10)
    got = {i: [] for i in range(5)}
    done = set()
    for step in range(300):
        if step < 5:
            engine.submit(step, prompts[step])
        for e in engine.step():
            got[e.request_id].extend(e.new_ids)
            if e.finished:
                done.add(e.request_id)
        if len(done) == 5:
            break
    assert len(done) == 5
    for i, prompt in enumerate(prompts):
        assert got[i] == solo(model, prompt, 20), i
