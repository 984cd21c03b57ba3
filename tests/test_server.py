"""`recguide serve` over localhost, with real clients (the `openai` package and plain HTTP): streamed text equals
plain greedy's, bad requests get OpenAI-shaped 4xx and the server keeps serving, the API key is checked before
anything runs, a client that leaves frees its row, a full queue answers 503. Every wait is bounded."""

import json
import os
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from recguide_hf import BUNDLED_MODEL  # noqa: E402
from recguide_hf.testing.server import burst, start_server, stop_server  # noqa: E402

KEY = "test-key-123"
pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(), reason="bundled weights missing")


@pytest.fixture(scope="module")
def server():
    try:
        proc, base = start_server(["--api-key", KEY, "--slots", "2", "--max-waiting", "1", "--max-tokens", "256",
                                   "--max-prompt-tokens", "512"], timeout=120,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    except RuntimeError as err:
        pytest.fail(str(err))
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def greedy():
    """Plain HF greedy text for a prompt (the reference every greedy response must equal)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, trust_remote_code=True, dtype="float32").eval()

    def run(prompt: str, max_tokens: int) -> str:
        ids = tok([prompt], return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=max_tokens, recguide_mode="ar", do_sample=False)
        return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    return run


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_streamed_completion_arrives_in_rounds_and_equals_greedy(client, greedy):
    prompt = "def add(a, b):"
    start, times, parts = time.monotonic(), [], []
    stream = client.completions.create(model="recguide-tiny", prompt=prompt, max_tokens=64, temperature=0,
                                       stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic() - start)
            parts.append(chunk.choices[0].text)
    assert len(parts) >= 3, parts
    assert times[0] < times[-1]
    assert "".join(parts) == greedy(prompt, 64)
    whole = client.completions.create(model="recguide-tiny", prompt=prompt, max_tokens=64, temperature=0)
    assert whole.choices[0].text == "".join(parts)
    assert whole.usage.completion_tokens <= 64 and whole.choices[0].finish_reason in ("stop", "length")


def test_stop_strings_cut_the_text(client, greedy):
    prompt = "def add(a, b):"
    full = greedy(prompt, 48)
    stop = full[10:13]
    out = client.completions.create(model="recguide-tiny", prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_a_prompt_as_token_ids_in_each_openai_form(client, greedy):
    """OpenAI's prompt forms: text, token ids, and a one-prompt batch of either (what lm-eval's local-completions
    sends); a batch of two prompts is refused."""
    from transformers import AutoTokenizer

    prompt = "def add(a, b):"
    ids = AutoTokenizer.from_pretrained(BUNDLED_MODEL)(prompt)["input_ids"]
    for form in (prompt, [prompt], ids, [ids]):
        out = client.completions.create(model="recguide-tiny", prompt=form, max_tokens=16, temperature=0)
        assert out.choices[0].text == greedy(prompt, 16), form
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model="recguide-tiny", prompt=[ids, ids], max_tokens=4, temperature=0)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = server + "/v1/completions"
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": "nope", "prompt": "x", "max_tokens": 4}).encode(), 404),
        (json.dumps({"model": "recguide-tiny", "prompt": "x", "max_tokens": -1}).encode(), 400),
        (json.dumps({"model": "recguide-tiny", "prompt": "x", "max_tokens": 10_000}).encode(), 400),
        (json.dumps({"model": "recguide-tiny", "prompt": [5] * 100_000, "max_tokens": 4}).encode(), 400),
        (json.dumps({"model": "recguide-tiny", "prompt": "hello " * 100_000, "max_tokens": 4}).encode(), 400),
        (json.dumps({"model": "recguide-tiny", "prompt": [5, 99_999], "max_tokens": 4}).encode(), 400),
        (json.dumps({"model": "recguide-tiny", "prompt": "x", "n": 2}).encode(), 400),
        (json.dumps({"model": "recguide-tiny", "messages": [{"role": "user", "content": "hi"}]}).encode(), 400),
    ]
    for body, status in cases:
        r = httpx.post(url if b"messages" not in body else server + "/v1/chat/completions", content=body,
                       headers=headers, timeout=30)
        assert r.status_code == status, (body[:80], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    big = httpx.post(url, content=b"x" * (2 << 20), headers=headers, timeout=30)
    assert big.status_code == 413
    ok = client.completions.create(model="recguide-tiny", prompt="ROMEO:", max_tokens=8, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_api_key_is_checked_before_anything_runs(server):
    before = metric(server, "recguide_generation_tokens_total")
    body = {"model": "recguide-tiny", "prompt": "def f(x):", "max_tokens": 8}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/v1/models", timeout=10).status_code == 401
    assert metric(server, "recguide_generation_tokens_total") == before
    listed = httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["recguide-tiny"]


def wait_until_freed(server: str, cancelled: float, seconds: float = 30):
    """Until the server counts one more cancelled request than `cancelled` and runs none (bounded)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (metric(server, "recguide_requests_cancelled_total") > cancelled
                and metric(server, "recguide_requests_running") == 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"the row was not freed within {seconds:.0f} s")


def test_a_client_that_leaves_frees_its_row(server):
    cancelled = metric(server, "recguide_requests_cancelled_total")
    body = {"model": "recguide-tiny", "prompt": "def main():", "max_tokens": 256, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then the client goes away mid-stream
    wait_until_freed(server, cancelled)


def test_a_non_streaming_client_that_gives_up_frees_its_row(server):
    cancelled = metric(server, "recguide_requests_cancelled_total")
    body = {"model": "recguide-tiny", "prompt": "def main():", "max_tokens": 256, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(60, read=0.3))
    wait_until_freed(server, cancelled)


def test_a_full_queue_answers_503(server, client):
    """2 slots + 1 waiting: of 5 long requests at once, some are refused, the rest finish."""
    results = burst(client, "recguide-tiny", 5, timeout=180)
    assert len(results) == 5 and set(results) <= {200, 503}
    assert results.count(503) >= 1 and results.count(200) >= 3


def test_a_model_with_layers_offloaded_to_disk_serves_plain_greedy(greedy, tmp_path):
    """`recguide serve --device-map ... --offload-folder`: half the bundled model's layers load from disk for each
    forward; a streamed greedy completion over the OpenAI API equals plain HF greedy on one device."""
    layers = json.loads((BUNDLED_MODEL / "config.json").read_text())["num_hidden_layers"]
    placed = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
              **{f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)}}
    try:
        proc, base = start_server(["--device-map", json.dumps(placed), "--offload-folder", str(tmp_path / "off"),
                                   "--slots", "2"], timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
        prompt = "def add(a, b):"
        chunks = [c.choices[0].text for c in client.completions.create(
            model="recguide-tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)]
        assert "".join(chunks) == greedy(prompt, 24)
    finally:
        stop_server(proc)
