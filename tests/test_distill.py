"""`recguide distill`: a tiny random Llama-style model made self-speculative end to end, resumed, exported as a Hub
folder that loads with trust_remote_code and decodes losslessly (= the base's HF greedy, fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from recguide_hf.models.export import assemble_folder
from recguide_hf.testing.tiny_llama import write_tiny_llama
from recguide_hf.tools.cli import main as cli_main

SMALL = ["--teacher-prompts", "24", "--eval-prompts", "4", "--teacher-batch", "8", "--new-tokens", "24",
         "--eval-minutes", "0.05", "--threads", "1", "--calibrate-prompts", "8", "--calibrate-tokens", "160",
         "--profile-concurrency", "1", "2", "--profile-repeats", "2", "--block-size", "8"]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    base = write_tiny_llama(root / "base")
    out, work = root / "out", root / "work"
    args = [str(base), str(out), "--work", str(work), "--mask-token", "<|draft|>", *SMALL]
    assert cli_main(["distill", *args, "--minutes", "0.1", "--stop-after", "train"]) == 0
    first = torch.load(work / "run" / "ckpt.pt", weights_only=False)["state"]
    assert cli_main(["distill", *args, "--minutes", "0.2"]) == 0  # the same command, a longer budget: resumes
    return {"base": base, "out": out, "work": work, "first": first}


def test_distill_resumes_and_records_each_invocation(distilled):
    work = distilled["work"]
    state = torch.load(work / "run" / "ckpt.pt", weights_only=False)["state"]
    first = distilled["first"]
    assert state["runs"] == 2 and state["step"] > first["step"] and state["elapsed"] >= 0.2 * 60
    assert state["log"][:len(first["log"])] == first["log"]  # the curve continues, nothing re-measured
    assert [e["step"] for e in state["log"]] == sorted(e["step"] for e in state["log"])
    commands = (work / "command.txt").read_text().splitlines()
    assert len(commands) == 2 and all(c.startswith("recguide distill ") for c in commands)
    assert "--stop-after train" in commands[0] and "--minutes 0.2" in commands[1]
    mask = json.loads((work / "mask.json").read_text())
    assert mask["mask_token"] == "<|draft|>" and mask["added"]


def test_resuming_with_another_adapter_shape_says_what_to_pass(distilled, tmp_path):
    import shutil

    work = shutil.copytree(distilled["work"], tmp_path / "work")
    args = [str(distilled["base"]), str(tmp_path / "out"), "--work", str(work), "--mask-token", "<|draft|>", *SMALL]
    with pytest.raises(ValueError, match="--init"):
        cli_main(["distill", *args, "--minutes", "0.3", "--rank", "4", "--stop-after", "train"])


def test_exported_folder_loads_with_remote_code_and_decodes_losslessly(distilled):
    out, work = distilled["out"], distilled["work"]
    for name in ("config.json", "generation_config.json", "modeling_recguide.py", "custom_generate/generate.py",
                 "draft_lora/adapter_model.safetensors", "value_table.json", "cost_table.json", "README.md",
                 "model.safetensors", "tokenizer.json"):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_recguide.RecGuideLlamaForCausalLM"}
    card = (out / "README.md").read_text()
    assert "recguide distill " in card and "tau" in card
    # the card's commands are portable: the base's folder (a path on this machine) reads BASE, in the log too
    assert str(distilled["base"]) not in card and "recguide distill BASE " in card
    log = json.loads((out / "draft_lora" / "distill_log.json").read_text())
    assert str(distilled["base"]) not in json.dumps(log["args"])
    # tau as decoding sees it: the engine's rounds on held-out and training prompts, output = the teacher rows
    last = log["log"][-1]
    for name in ("chat", "code", "train"):
        assert last[f"tau_B8_{name}"] >= 1.0 and last[f"tpf_B8_{name}"] > 0 and last[f"equal_{name}"] is True
        assert f"| {name} | " in card
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "RecGuideLlamaForCausalLM" and hasattr(model, "draft_adapter")
    mask_id = config["mask_token_id"]
    assert tok.convert_ids_to_tokens(mask_id) == "<|draft|>"
    base = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32)  # the base with the MASK row
    assert base.config.vocab_size == config["vocab_size"] == len(tok)
    enc = tok(["def add(a, b):\n    return", "import os\nimport sys\n"], return_tensors="pt", padding=True)
    ref = base.generate(**enc, max_new_tokens=32, do_sample=False, suppress_tokens=[mask_id])
    for mode in ("recguide", "linear"):
        out_ids = model.generate(**enc, max_new_tokens=32, recguide_mode=mode)
        assert torch.equal(out_ids, ref), mode
    # the drafting adapter is live: draft-mode logits differ from the adapter-off ones
    from recguide_hf.models.draft_adapter import route

    ids = torch.tensor([[5, 6, mask_id, mask_id]])
    plain = model(input_ids=ids).logits
    with route(model.draft_adapter, 0):
        drafted = model(input_ids=ids).logits
    assert not torch.allclose(plain, drafted)


def test_without_weights_and_refusals(distilled, tmp_path):
    parts = distilled["work"] / "parts"
    slim = assemble_folder(distilled["work"] / "base", parts, tmp_path / "slim", 3, weights=False)
    assert not list(slim.glob("*.safetensors")) and (slim / "draft_lora" / "adapter_model.safetensors").exists()
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(NotImplementedError, match="gpt2"):
        assemble_folder(odd, None, tmp_path / "x", 0)


def test_mask_token_taken_added_or_placed_in_a_padded_row(tmp_path):
    """load_base: a token the vocabulary has is taken (the model unchanged); a new one is added, as a new embedding
    row or, when the embedding is padded past the tokenizer (Qwen's), in the first unused row, set to the mean."""
    from recguide_hf.tools.distill.make import load_base

    base = write_tiny_llama(tmp_path / "base")
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model, tok, added = load_base(base, "<|mask|>")
    assert not added and model.config.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values()))
    model, tok, added = load_base(base, "<|draft|>")
    assert added and model.config.mask_token_id == len(tok) - 1 == original.config.vocab_size
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    padded = write_tiny_llama(tmp_path / "padded", vocab_pad=8)
    rows = AutoModelForCausalLM.from_pretrained(padded, dtype=torch.float32).get_input_embeddings().weight.shape[0]
    model, tok, added = load_base(padded, "<|draft|>")
    emb = model.get_input_embeddings().weight
    assert added and emb.shape[0] == rows and model.config.mask_token_id < rows
    assert torch.allclose(emb[model.config.mask_token_id], emb[:len(tok) - 1].mean(0))


@pytest.mark.parametrize("first_draft", ["mask", "verifier"])
def test_the_layout_distill_trains_is_the_layout_the_engine_drafts(tmp_path, first_draft):
    """The draft forward `recguide distill` trains and measures with (`loop.block_layout` + `seed_layout` + the
    adapter's routing, on the clean prefix's cache) gives the logits the engine's own draft forward gives for the
    same prefix and seed, so what training optimises and what decoding runs cannot drift apart (fp32, atol 1e-4).
    Each row's first round is compared: seed = the prompt's last token, block [seed, MASK x (B-1)]."""
    from argparse import Namespace

    from transformers import DynamicCache

    from recguide_hf.core.config import DecodingConfig
    from recguide_hf.core.engine import Engine, SamplingSettings
    from recguide_hf.core.masks import additive_mask, left_pad
    from recguide_hf.models.compat import CACHE_KW
    from recguide_hf.models.draft_adapter import route
    from recguide_hf.models.registry import as_backbone
    from recguide_hf.tools.distill.loop import AdapterStudent, block_layout, seed_layout

    base = write_tiny_llama(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.config.mask_token_id = mask = 5
    student = AdapterStudent(model, Namespace(init=None, rank=4, alpha=8.0, targets=["q_proj", "o_proj", "up_proj"],
                                              first_draft=first_draft))
    with torch.no_grad():
        for b in student.adapter.lora_B:
            b.normal_(0, 0.5)  # a trained adapter: not the identity
    block = 6
    prompts = [[11, 40, 7, 19, 23, 60, 31], [12, 8, 90, 14]]  # rows of different lengths: left padding in the engine
    backbone = as_backbone(model)
    seen = []
    forward = backbone.forward

    def recording(ids, pos, mask_, cache, draft_mask=None, logits_to_keep=0):
        logits = forward(ids, pos, mask_, cache, draft_mask=draft_mask, logits_to_keep=logits_to_keep)
        if draft_mask is not None and not seen:  # the first draft forward
            seen.append((ids.clone(), pos.clone(), logits.clone()))
        return logits

    backbone.forward = recording
    ids, attn = left_pad(prompts, 0)
    settings = SamplingSettings(max_new_tokens=block, eos_token_ids=[], pad_token_id=0)
    with torch.no_grad():
        Engine(backbone, DecodingConfig(mode="linear", block_size=block, first_draft=first_draft),
               settings).generate(ids, attn)
    engine_ids, engine_pos, engine_logits = seen[0]
    for r, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        t = len(prompt) - 1  # the seed's position
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=x[:, :t], use_cache=True, **{CACHE_KW: cache})
            block_ids, pos, _, allowed = block_layout(x[:, :t + 1], torch.tensor([[t]]), block, mask)
            allowed = allowed[..., [*range(t), *range(t + 1, t + 1 + block)]]  # the keys: the cached prefix + block
            draft_mask, allowed = seed_layout(block_ids, allowed, mask, first_draft)
            with route(student.adapter, draft_mask):
                logits = model(input_ids=block_ids, position_ids=pos, attention_mask=additive_mask(allowed),
                               use_cache=True, **{CACHE_KW: cache}).logits
        assert torch.equal(engine_ids[r], block_ids[0]) and torch.equal(engine_pos[r], pos[0])
        torch.testing.assert_close(engine_logits[r], logits[0], atol=1e-4, rtol=0)


def test_a_larger_teacher_budget_adds_a_shard_of_prompts_not_made_yet(tmp_path, monkeypatch):
    """`--teacher-minutes` is the rows' budget in all: a run offering more prompts within it adds `train_2.npz`, of
    prompts the first shard does not hold; training draws from every shard; a spent budget adds nothing; an offer
    already made is not built again."""
    from recguide_hf.tools.distill import prompts as prompts_module
    from recguide_hf.tools.distill.teacher import TeacherRows, prompts_in, shards_info, train_shards

    base = write_tiny_llama(tmp_path / "base")
    args = [str(base), str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--mask-token", "<|draft|>", *SMALL,
            "--stop-after", "teacher"]
    teacher = tmp_path / "work" / "teacher"
    assert cli_main(["distill", *args]) == 0
    assert train_shards(teacher) == [teacher / "train.npz"]
    first = shards_info(teacher)
    assert json.loads((teacher / "offers.json").read_text())["made"] == [
        {"teacher_prompts": 24, "chat_share": 0.7, "seed": 0}]
    built = prompts_module.prompt_mix
    monkeypatch.setattr(prompts_module, "prompt_mix", lambda *a, **k: pytest.fail("an offer made is built again"))
    assert cli_main(["distill", *args]) == 0  # the same offer again: every prompt is made, no shard
    assert train_shards(teacher) == [teacher / "train.npz"]
    monkeypatch.setattr(prompts_module, "prompt_mix", built)
    assert cli_main(["distill", *args, "--teacher-prompts", "40"]) == 0
    shards = train_shards(teacher)
    assert shards == [teacher / "train.npz", teacher / "train_2.npz"]
    one, two = (prompts_in(p) for p in shards)
    assert two and not one & two
    total = shards_info(teacher)
    second = json.loads((teacher / "train_2.json").read_text())["rows"]
    assert total["shards"] == 2 and total["rows"] == first["rows"] + second == len(TeacherRows(shards, 4, 0))
    assert total["continuation_tokens"] > first["continuation_tokens"]
    assert cli_main(["distill", *args, "--teacher-prompts", "60", "--teacher-minutes", "0.01"]) == 0  # spent
    assert len(train_shards(teacher)) == 2


def test_prompts_whose_rows_hold_the_mask_token_are_recorded_and_not_continued_again(tmp_path):
    """A prompt whose greedy continuation holds the MASK token makes no row; `Offers` records it, so a later
    `recguide distill` with budget left skips it instead of continuing it again."""
    from recguide_hf.tools.distill.teacher import Offers, make_teacher_rows

    base = write_tiny_llama(tmp_path / "base")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    prompts = [tokenizer(t).input_ids for t in ("def add(a, b):", "The sky is", "Once upon a time", "1, 2, 3,")]
    clean = make_teacher_rows(model, tokenizer, prompts, tmp_path / "all.npz", new_tokens=8, batch_size=2)
    assert clean["rows"] == 4 and clean["dropped_prompts"] == []
    blob = np.load(tmp_path / "all.npz")
    lo = int(blob["lo"][0])
    prompt, mask_id = blob["tokens"][0, :lo].tolist(), int(blob["tokens"][0, lo])  # a row's first continued token
    info = make_teacher_rows(model, tokenizer, prompts, tmp_path / "some.npz", new_tokens=8, batch_size=2,
                             mask_id=mask_id)  # as if it were the MASK
    assert prompt in info["dropped_prompts"]
    assert info["rows"] + len(info["dropped_prompts"]) == 4 == info["prompts_offered"]
    assert info["rows_with_mask_token_dropped"] == len(info["dropped_prompts"])
    Offers(tmp_path).record({"teacher_prompts": 4}, info["dropped_prompts"])
    again = Offers(tmp_path)
    assert again.made == [{"teacher_prompts": 4}] and tuple(prompt) in again.dropped


def test_the_card_carries_the_work_folders_note_on_where_its_commands_start_from(distilled, tmp_path):
    """`WORK/card_note.md` (written by the run's owner: what an `--init` named, where a linked `teacher/` came from)
    goes into the card after the commands; without it the card has no such paragraph."""
    import shutil

    from recguide_hf.tools.distill.finish import card
    from recguide_hf.tools.distill.make import parser

    work = shutil.copytree(distilled["work"], tmp_path / "work")
    args = parser().parse_args([str(distilled["base"]), str(distilled["out"]), "--work", str(work), *SMALL])
    tok = AutoTokenizer.from_pretrained(distilled["out"])
    note = "The first command's `--init` named the adapter of an earlier run."
    assert note not in card(args, tok, work, work / "parts")
    (work / "card_note.md").write_text(note + "\n")
    text = card(args, tok, work, work / "parts")
    assert text.index("recguide distill BASE ") < text.index(note) < text.index("`recguide distill` resumes")
