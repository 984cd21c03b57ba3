"""`recguide distill`: a tiny random Llama-style model made self-speculative end to end, resumed, exported as a Hub
folder that loads with trust_remote_code and decodes losslessly (= the base's HF greedy, fp32)."""

from __future__ import annotations

import json

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
