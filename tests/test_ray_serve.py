"""`recguide serve --replicas N`: RecGuide replicas on Ray Serve.

Fast: the Serve config the flags write validates against Serve's own schema; a replica's app (the server's app
with its replica named) adds the replica header and metrics; the flags are checked. Slow: a real local Ray
instance on 127.0.0.1 (started and stopped by the test through `recguide serve`) with 2 replicas of the bundled
model: the server says it is ready only once the proxy routes to both replicas (the first burst is served by
both), greedy responses over the `openai` client equal plain HF greedy, a streaming client that leaves and a
non-streaming one that gives up both free their rows, a burst past the rows and queue gets Serve's plain-text 503
and then service resumes, and a replica killed by its pid is replaced while the other keeps serving (the client
gets the proxy's 500 or a cut connection). Every wait is bounded."""

import os
import re
import signal
import threading
import time

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

from recguide_hf import BUNDLED_MODEL  # noqa: E402
from recguide_hf.serving import ray_serve  # noqa: E402
from recguide_hf.testing.server import burst, start_server, stop_server  # noqa: E402
from recguide_hf.tools import cli  # noqa: E402

REPLICA = ray_serve.REPLICA_HEADER
bundled = pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(), reason="bundled weights missing")


def test_the_config_the_flags_write_is_serves_own_format(tmp_path, capsys):
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "serve.yaml"
    assert cli.main(["serve", "--autoscale", "1:3", "--slots", "8", "--max-waiting", "5", "--threads-per-replica", "2",
                     "--api-key", "k", "--ray-config", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600  # it holds the API key
    schema = ServeDeploySchema.model_validate(yaml.safe_load(out.read_text()))
    assert (schema.http_options.host, schema.http_options.port) == ("127.0.0.1", 8000)
    app = schema.applications[0]
    assert app.import_path == "recguide_hf.serving.ray_serve:build" and app.route_prefix == "/"
    assert app.args == {"model": None, "threads": 2, "slots": 8, "api_key": "k"}
    dep = app.deployments[0]
    assert (dep.max_ongoing_requests, dep.max_queued_requests) == (8, 5)  # a replica takes as many as its rows
    assert dep.autoscaling_config["min_replicas"] == 1 and dep.autoscaling_config["max_replicas"] == 3
    assert dep.autoscaling_config["target_ongoing_requests"] == 4.0
    assert dep.ray_actor_options.num_cpus == 2
    assert dep.ray_actor_options.runtime_env == {"env_vars": {"OMP_NUM_THREADS": "2"}}
    # the builder `serve run` imports takes those args and makes the same deployment
    built = ray_serve.build(app.args)
    assert built._bound_deployment.name == "RecGuide"


@pytest.mark.parametrize("flags, message", [
    (["--autoscale", "2:1"], "MIN <= MAX"),
    (["--autoscale", "two"], "MIN:MAX"),
    (["--replicas", "2", "--device-map", "auto"], "one process only"),
    (["--replicas", "2", "--autoscale", "1:2"], "not both"),
    (["--replicas", "2", "--max-waiting", "0"], "takes 1 or more"),
    (["--replicas", "2", "--target-ongoing", "4"], "need --autoscale"),
    (["--threads-per-replica", "2"], "add --replicas N"),
    (["--replicas", "3", "--threads-per-replica", "2", "--ray-cpus", "4"], "would never start"),
])
def test_bad_replica_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", *flags])
    assert message in capsys.readouterr().err


@bundled
def test_a_replicas_app_names_it_in_headers_and_metrics():
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from recguide_hf.models.loading import load
    from recguide_hf.serving.app import build_app
    from recguide_hf.serving.worker import EngineWorker, WorkerLimits

    tok, model = load(None)
    worker = EngineWorker(model, WorkerLimits(slots=3)).start()
    try:
        app = build_app(worker, AutoTokenizer.from_pretrained(BUNDLED_MODEL), "recguide-tiny", replica=("r1", 4242))
        with TestClient(app) as http:
            r = http.post("/v1/completions", json={"model": "recguide-tiny", "prompt": "def f(x):", "max_tokens": 4})
            assert r.status_code == 200 and r.headers[REPLICA] == "r1"
            bad = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert bad.status_code == 404 and bad.headers[REPLICA] == "r1"  # errors are named too
            metrics = http.get("/metrics").text
        assert 'recguide_replica_info{replica="r1",pid="4242"} 1' in metrics
        assert "recguide_free_rows 3" in metrics
    finally:
        worker.stop()


def scrape(base: str) -> tuple[str, dict, int]:
    r = httpx.get(base + "/metrics", timeout=10)
    values = {k: float(v) for k, _, v in (line.rpartition(" ") for line in r.text.splitlines()
                                          if line and not line.startswith("#"))}
    pid = int(re.search(r'recguide_replica_info\{replica="[^"]*",pid="(\d+)"\}', r.text).group(1))
    return r.headers[REPLICA], values, pid


def try_scrape(base: str):
    """`scrape`, or None while the proxy answers with its own error (a replica just died)."""
    try:
        return scrape(base)
    except (httpx.HTTPError, KeyError, AttributeError, ValueError):
        return None


def until(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"{what} within {seconds:.0f} s")


@bundled
@pytest.mark.slow
def test_two_replicas_on_a_local_ray_serve_greedy_leave_overload_and_a_killed_replica():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, trust_remote_code=True, dtype="float32").eval()
    prompts = ["def add(a, b):", "class Stack:", "import os\n\ndef main():", "First Citizen:\n"]
    expect = {}
    for prompt in prompts:
        ids = tok([prompt], return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=24, recguide_mode="ar", do_sample=False)
        expect[prompt] = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    proc, base = start_server(["--replicas", "2", "--ray-cpus", "2", "--slots", "4", "--max-waiting", "8",
                               "--max-tokens", "256"], timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              ready_text="Ray Serve replica")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
        results, lock = [], threading.Lock()

        errors = []

        def ask(prompt: str, stream: bool):
            raw = client.completions.with_raw_response.create(model="recguide-tiny", prompt=prompt, max_tokens=24,
                                                              temperature=0, stream=stream)
            out = raw.parse()
            text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
            with lock:
                results.append((prompt, text, raw.headers[REPLICA]))

        def ask_logged(prompt: str, stream: bool):
            try:
                ask(prompt, stream)
            except Exception as err:  # noqa: BLE001 - shown by the assertion below
                errors.append(repr(err))

        threads = [threading.Thread(target=ask_logged, args=(p, k % 2 == 0)) for k in range(2) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(results) == 8 and not errors, errors
        assert all(text == expect[p] for p, text, _ in results)
        served = {r for _, _, r in results}
        # the first burst after the ready line: 8 requests, 4 rows a replica. Had the proxy known one replica only
        # (it learns of a late one a moment after Serve reports the application up), all 8 would have gone to it,
        # the last 4 queued there: the server prints its URL only once the proxy routes to both
        assert len(served) == 2, served

        # a client that leaves mid-stream: the replica that served it counts it cancelled and frees the row
        body = {"model": "recguide-tiny", "prompt": "def main():", "max_tokens": 256, "temperature": 0,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", base + "/v1/completions", json=body) as r:
            left_on = r.headers[REPLICA]
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        def freed():
            got = try_scrape(base)
            return got is not None and got[0] == left_on and got[1]["recguide_requests_cancelled_total"] >= 1 \
                and got[1]["recguide_requests_running"] == 0

        until(freed, 60, "the left row was not freed")

        # a NON-streaming client that gives up: Serve's proxy cancels its request on the replica (the route's task
        # gets CancelledError), which frees the row: its replica counts one more cancelled request, none running
        def per_replica() -> dict:
            seen: dict = {}
            until(lambda: (seen.update([(g[0], g[1]) for g in [try_scrape(base)] if g]), len(seen) == 2)[1], 60,
                  "both replicas' metrics")
            return seen

        cancelled = sum(v["recguide_requests_cancelled_total"] for v in per_replica().values())
        quitter = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=0.3, max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            quitter.completions.create(model="recguide-tiny", prompt="def main():", max_tokens=256, temperature=0)
        until(lambda: (lambda m: sum(v["recguide_requests_cancelled_total"] for v in m.values()) > cancelled
                       and all(v["recguide_requests_running"] == 0 for v in m.values()))(per_replica()), 60,
              "the row of a non-streaming client that gave up was not freed")


        # 2 replicas x 4 rows + 8 queued: a burst of 40 long requests gets 503s, then service resumes
        refusals: list = []
        codes = burst(client, "recguide-tiny", 40, timeout=300, refusals=refusals)
        assert len(codes) == 40 and set(codes) <= {200, 503} and codes.count(503) >= 1, codes
        # Serve's proxy refuses before any replica sees the request, in its own shape (no hook in Serve 2.60 makes
        # it OpenAI's: docs/serving.md): plain text, which the openai client still raises as a 503 status error
        status, kind, text = refusals[0]
        assert status == 503 and kind.startswith("text/plain") and "backpressure" in text, refusals[0]
        ask(prompts[0], False)
        assert results[-1][1] == expect[prompts[0]]

        # a replica killed by its pid: Serve replaces it; requests meanwhile end (ok or a clear error), none hangs
        victim, _, pid = scrape(base)
        os.kill(pid, signal.SIGKILL)
        after = []

        def ask_after():
            try:
                ask(prompts[1], False)
                after.append("ok")
            except openai.APIError as err:
                after.append(type(err).__name__)

        for _ in range(6):
            ask_after()
        assert "ok" in after, after  # the other replica serves
        # what a request sent to the dead replica gets: the proxy's plain-text 500, or a cut connection
        assert set(after) <= {"ok", "InternalServerError", "APIConnectionError"}, after
        assert all(p == prompts[1] and text == expect[p] for p, text, _ in results[-after.count("ok"):])
        ids = set()
        until(lambda: (ids.add((try_scrape(base) or (victim,))[0]), len(ids - {victim}) >= 2)[1], 300,
              "no replacement replica answered")
        lines = proc.replica_lines
        assert len(lines) >= 2 and lines[0].endswith("replicas: 2 running"), lines  # the server saw it go
        until(lambda: proc.replica_lines[-1].endswith("replicas: 2 running"), 60,
              "the server did not report 2 running replicas again")
    finally:
        stop_server(proc, timeout=120)
    assert proc.returncode is not None
