"""The HF entry: where settings come from, output format, clear errors for what is not supported."""

import pytest
import torch
from conftest import left_pad, random_prompts, tiny_model
from transformers import AutoModelForCausalLM, GenerationConfig

import recguide_hf
from recguide_hf.core.config import DecodingConfig
from recguide_hf.integrations.hf_assist import EntropyRecorder, assisted_generate
from recguide_hf.models.export import save_model_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_model_folder(tiny_model(seed=2), None, path, recguide_block_size=5)
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


def stats_of(model, **kw):
    ids = torch.tensor([[5, 6, 7, 8]])
    return model.generate(ids, max_new_tokens=12, return_dict_in_generate=True, **kw).recguide_stats


def test_settings_from_generation_config_file(folder):
    assert set(stats_of(folder)["block_sizes"]) == {5}


def test_settings_from_passed_generation_config_and_kwargs(folder):
    gc = GenerationConfig(**folder.generation_config.to_dict())
    gc.recguide_block_size = 3
    assert set(stats_of(folder, generation_config=gc)["block_sizes"]) == {3}
    assert set(stats_of(folder, generation_config=gc, recguide_block_size=7)["block_sizes"]) == {7}  # kwarg wins
    assert set(stats_of(folder, recguide_block_size="4")["block_sizes"]) == {4}  # lm-eval passes strings
    assert DecodingConfig.from_sources(gc, recguide_online_costs="false").online_costs is False
    tuned = DecodingConfig.from_sources(gc, recguide_online_optimism="0.1", recguide_online_prior="16")
    assert (tuned.online_optimism, tuned.online_prior) == (0.1, 16.0)


def test_ar_mode_is_plain_hf(folder):
    ids = torch.tensor([[5, 6, 7, 8]])
    out = folder.generate(ids, max_new_tokens=6, recguide_mode="ar", return_dict_in_generate=True)
    assert not hasattr(out, "recguide_stats") or out.recguide_stats is None


def test_output_layout_matches_hf(folder):
    ids, mask = left_pad(random_prompts(4, 96, seed=3))
    ref = folder.generate(ids, attention_mask=mask, max_new_tokens=9, recguide_mode="ar")
    out = folder.generate(ids, attention_mask=mask, max_new_tokens=9, return_dict_in_generate=True)
    assert out.sequences.shape == ref.shape and torch.equal(out.sequences, ref)
    s = out.recguide_stats
    for key in ("new_tokens", "forwards", "rounds", "tpf", "tau", "query_tokens", "hits", "block_sizes", "per_request"):
        assert key in s
    assert len(s["per_request"]) == 4 and sum(r["new_tokens"] for r in s["per_request"]) == s["new_tokens"]


@pytest.mark.parametrize("bad, needle", [
    (dict(recguide_block_size=0), "recguide_block_size=0"),
    (dict(recguide_block_size=1000), "recguide_block_size=1000"),
    (dict(recguide_block_size="big"), "recguide_block_size='big'"),
    (dict(recguide_mode="fast"), "recguide_mode='fast'"),
    (dict(recguide_delta=0), "recguide_delta=0"),
    (dict(recguide_delta=1.5), "recguide_delta=1.5"),
    (dict(recguide_max_corrections=-1), "recguide_max_corrections=-1"),
    (dict(recguide_max_corrections=3), "recguide_max_corrections=3"),
    (dict(recguide_overlap="gpu-magic"), "recguide_overlap='gpu-magic'"),
    (dict(recguide_online_costs="sometimes"), "recguide_online_costs='sometimes'"),
    (dict(recguide_online_optimism=-0.1), "recguide_online_optimism=-0.1"),
    (dict(recguide_online_prior=0), "recguide_online_prior=0"),
    (dict(recguide_online_prior="many"), "recguide_online_prior='many'"),
    (dict(recguide_blocksize=8), "recguide_blocksize"),
    (dict(num_beams=2), "beam search"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(prompt_lookup_num_tokens=3), "assisted generation"),
])
def test_bad_settings_raise_clear_errors(folder, bad, needle):
    with pytest.raises(ValueError) as err:
        folder.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, **bad)
    assert needle in str(err.value)


def test_hf_assisted_loop_with_self_drafting_pair():
    model = tiny_model(seed=8)
    recorder = EntropyRecorder()
    for prompt in random_prompts(5, 96, min_len=2, seed=4):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, max_new_tokens=15, do_sample=False)
        out = model.generate(ids, max_new_tokens=15, custom_generate=assisted_generate, recguide_block_size=4,
                             logits_processor=[recorder])
        assert torch.equal(out, ref)
    assert len(recorder.entropies) >= 5 * 15 and all((e >= 0).all() for e in recorder.entropies)


def test_recguide_generate_accepts_model_first(folder):
    ids = torch.tensor([[5, 6, 7]])
    a = recguide_hf.generate(folder, ids, max_new_tokens=5)
    b = folder.generate(ids, max_new_tokens=5)
    assert torch.equal(a, b)


def test_stats_say_whether_branches_rode_and_why_not(folder, tmp_path):
    """Without a cost table branches ride every round; a cost table that prices them out turns them off, and the
    statistics say so in words (the CLI prints that line)."""
    assert stats_of(folder, recguide_mode="linear")["branches"].startswith("off (LinearSS")
    assert stats_of(folder)["branches"].startswith("on in 100% of rounds")
    dear = tmp_path / "dear.json"
    dear.write_text('{"costs": {"1": {"5": {"draft": 0.001, "verify": [0.01, 1.0, 2.0, 3.0]}}}}')
    assert stats_of(folder, recguide_cost_table=str(dear))["branches"].startswith("off in every round: the cost table")
    assert stats_of(folder, recguide_block_size=1)["branches"].startswith("off: every round was a plain decoding step")


def test_first_call_logs_one_info_line(folder, caplog):
    """lm-eval's stock backend shows no sign of RecGuide otherwise: the `recguide_hf` logger says it at INFO."""
    import importlib

    gen_module = importlib.import_module("recguide_hf.integrations.generate")
    gen_module._RUN = gen_module._RunLog()  # as in a fresh process
    with caplog.at_level("INFO", logger="recguide_hf"):
        stats_of(folder)
        stats_of(folder)
        lines = [r.getMessage() for r in caplog.records if r.name == "recguide_hf" and r.levelname == "INFO"]
        assert len(lines) == 1 and "RecGuide decoding (first generate call): mode=recguide block_size=5 TPF" in lines[0]
        gen_module._RUN.totals()  # what atexit prints
    assert "RecGuide totals over 2 generate calls" in caplog.records[-1].getMessage()


def test_an_lm_eval_run_says_which_decoding_ran(folder, caplog, monkeypatch):
    """With the `recguide_hf` logger left silent, a process that imported lm-eval gets the first-call line on
    lm-eval's own logger (`lm_eval.recguide_hf`), which lm-eval prints at its default INFO level."""
    import importlib
    import logging
    import sys

    gen_module = importlib.import_module("recguide_hf.integrations.generate")
    monkeypatch.setattr(gen_module, "_RUN", gen_module._RunLog())
    monkeypatch.setitem(sys.modules, "lm_eval", sys.modules.get("lm_eval") or object())
    monkeypatch.setattr(logging.getLogger("recguide_hf"), "level", logging.WARNING)
    with caplog.at_level("INFO", logger="lm_eval.recguide_hf"):
        stats_of(folder)
    lines = [r.getMessage() for r in caplog.records if r.name == "lm_eval.recguide_hf"]
    assert len(lines) == 1 and lines[0].startswith("RecGuide decoding (first generate call): mode=recguide")
