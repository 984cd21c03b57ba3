"""A load test of `recguide serve` over localhost (one process, or Ray Serve replicas): many `openai` clients at
once, streaming and not, for a fixed time; every greedy response checked against plain HF greedy.

    python eval/serve_load.py --clients 32 --seconds 60 --out eval/results/serve_load.json
    python eval/serve_load.py --replicas 2 --clients 32 --seconds 60 --out eval/results/ray/load.json
    python eval/serve_load.py --replicas 2 --clients 16 --seconds 45 --kill-replica-at 15 \
        --out eval/results/ray/kill.json
    python eval/serve_load.py --autoscale 1:2 --clients 16 --seconds 45 --idle 75 --out eval/results/ray/autoscale.json

Starts the server (the bundled model unless --model) on a free local port, warms it up with every row busy
once, records the resident memory of its decoding processes (the server, or each Ray replica), runs `--clients`
threads with the `openai` client for `--seconds` (each picks a prompt and streaming or not from a seeded stream,
greedy, `--max-tokens`), then checks every response against plain HF greedy for its prompt; memory again right
after the load and at the end. Every request is accounted for: finished, failed (with its error; a stream that
ends without a finish reason counts as failed) or still open when the time ran out (the run waits for those,
bounded by the client timeout). Then, unless
`--no-checks`: a client that leaves mid-stream frees its row on the replica that served it (that replica's
/metrics), and a burst over the server's rows + queue gets 429/503, after which a request succeeds again.

With Ray (`--replicas N` / `--autoscale MIN:MAX`): responses are counted per replica (`x-recguide-replica`);
`--kill-replica-at S` SIGKILLs one replica's process S seconds into the load (its pid from /metrics); the
server's replica-count lines (`HH:MM:SS replicas: ...`) are recorded, and `--idle S` waits after the load for
autoscaling to scale down.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil

from recguide_hf import BUNDLED_MODEL
from recguide_hf.testing.server import burst, start_server, stop_server
from recguide_hf.tools.prompts import load_mixed

REPLICA = "x-recguide-replica"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def scrape(base: str) -> tuple[str | None, dict[str, float], int | None]:
    """(replica id, {metric line key: value}, pid) from one GET /metrics (whichever replica answers)."""
    r = httpx.get(base + "/metrics", timeout=10)
    values, pid = {}, None
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
            m = re.match(r'recguide_replica_info\{replica="[^"]*",pid="(\d+)"\}', line)
            if m:
                pid = int(m.group(1))
    return r.headers.get(REPLICA), values, pid


def replicas(base: str, want: int, tries: int = 60) -> dict[str | None, tuple[dict, int | None]]:
    """{replica id: (metrics, pid)} from /metrics, asked until `want` replicas answered (or `tries` ran out)."""
    seen: dict = {}
    for _ in range(tries):
        rid, values, pid = scrape(base)
        seen[rid] = (values, pid)
        if len(seen) >= want:
            break
    return seen


def rss_mb(pids) -> float:
    return sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20


def one_request(client, name: str, prompt: str, max_tokens: int, streaming: bool) -> dict:
    rec: dict = {"stream": streaming, "start": time.monotonic()}
    try:
        raw = client.completions.with_raw_response.create(model=name, prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0, stream=streaming)
        rec["replica"] = raw.headers.get(REPLICA)
        out = raw.parse()
        if streaming:
            parts, times, finish = [], [], None
            for chunk in out:
                if chunk.choices and chunk.choices[0].text:
                    parts.append(chunk.choices[0].text)
                    times.append(time.monotonic())
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            rec["text"] = "".join(parts)
            rec["ttft"] = times[0] - rec["start"] if times else None
            rec["gaps"] = [b - a for a, b in zip(times, times[1:])]
            if finish is None:
                raise RuntimeError("the stream ended without a finish reason")
        else:
            rec["text"] = out.choices[0].text
        rec["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - every failure is counted and shown
        rec["status"], rec["error"] = "failed", repr(err)[:300]
    rec["seconds"] = time.monotonic() - rec["start"]
    return rec


def warm_up(client, name: str, prompts: list[str], count: int, max_tokens: int):
    """`count` requests at once (every row busy once: the batch's widest forwards), half streaming."""
    warm = [threading.Thread(target=one_request, args=(client, name, prompts[k % len(prompts)], max_tokens,
                                                       k % 2 == 0)) for k in range(count)]
    for t in warm:
        t.start()
    for t in warm:
        t.join(timeout=600)


def closed_loop(client, name: str, prompts: list[str], clients: int, seconds: float, max_tokens: int, seed: int,
                timeout: float, stream_share: float = 0.5, timer: threading.Timer | None = None):
    """`clients` threads for `seconds`: client k draws a prompt and streaming-or-not from its own seeded stream,
    request after request (`timer`, if given, starts with them). Returns (records, seconds the load took,
    clients still open: waited for up to the client `timeout`)."""
    records, lock = [], threading.Lock()
    start = time.monotonic()
    end = start + seconds

    def worker(k: int):
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < end:
            i, streaming = rng.randrange(len(prompts)), rng.random() < stream_share
            rec = one_request(client, name, prompts[i], max_tokens, streaming)
            rec["prompt"] = i
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    if timer:
        timer.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()) + timeout + 30)
    return records, time.monotonic() - start, sum(t.is_alive() for t in threads)


def leave_mid_stream(base: str, name: str, want: int) -> dict:
    """A client reads one chunk of a long stream and leaves: the replica that served it counts a cancelled
    request and its running rows drop back (bounded wait)."""
    before = replicas(base, want)
    body = {"model": name, "prompt": "def main():", "max_tokens": 256, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", base + "/v1/completions", json=body) as r:
        served_by = r.headers.get(REPLICA)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    key = "recguide_requests_cancelled_total"
    start = before.get(served_by, ({key: 0.0}, None))[0].get(key, 0.0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rid, values, _ = scrape(base)
        if rid == served_by and values.get(key, 0) > start and values.get("recguide_requests_running", 1) == 0:
            return {"replica": served_by, "cancelled_before": start, "cancelled_after": values[key],
                    "running_after": values["recguide_requests_running"],
                    "free_rows_after": values.get("recguide_free_rows"), "freed": True,
                    "seconds": 30 - (deadline - time.monotonic())}
        time.sleep(0.2)
    return {"replica": served_by, "freed": False}


def overload(client, name: str, count: int) -> dict:
    """`count` long requests at once (more than the rows and the queue): their status codes, then one more."""
    codes = burst(client, name, count, timeout=600)
    after = client.completions.create(model=name, prompt="def f(x):", max_tokens=8, temperature=0)
    return {"sent": count, "codes": dict(collections.Counter(map(str, codes))),
            "refused": sum(c in (429, 503) for c in codes), "served_after": after.choices[0].finish_reason is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts (HumanEval and prose, interleaved)")
    p.add_argument("--slots", type=int, default=32, help="rows per server (per replica with Ray)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests (Serve's queue with Ray)")
    p.add_argument("--replicas", type=int, default=None, help="serve on Ray Serve with N replicas")
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX", help="Ray Serve replicas, autoscaled")
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--kill-replica-at", type=float, default=None, metavar="S",
                   help="SIGKILL one replica's process S seconds into the load")
    p.add_argument("--idle", type=float, default=0, help="seconds to wait after the load (autoscaling down)")
    p.add_argument("--no-checks", action="store_true", help="skip the leave-mid-stream and overload checks")
    p.add_argument("--timeout", type=float, default=120, help="each client request's timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    ray = args.replicas is not None or args.autoscale is not None
    prompts = load_mixed((args.prompts + 1) // 2)[: args.prompts]
    flags = ["--model", str(args.model), "--slots", str(args.slots), "--max-waiting", str(args.max_waiting)]
    env = dict(os.environ)
    if ray:
        flags += (["--replicas", str(args.replicas)] if args.replicas else ["--autoscale", args.autoscale])
        flags += ["--threads-per-replica", str(args.threads_per_replica), "--ray-cpus", str(os.cpu_count())]
        flags += ["--upscale-delay", "3", "--downscale-delay", "20"] if args.autoscale else []
        env["OMP_NUM_THREADS"] = str(args.threads_per_replica)
    started = time.monotonic()
    proc, base = start_server(flags, timeout=600, env=env, ready_text="Ray Serve replica" if ray else None)
    print(f"server up in {time.monotonic() - started:.0f} s", flush=True)
    name = args.model.name
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=args.timeout, max_retries=0)
    want = args.replicas or (int(args.autoscale.split(":")[0]) if args.autoscale else 1)
    # warm-up: every row of every replica busy once (the batch's widest forwards), so "before" is the memory of a
    # server that has seen full load, and a growth after the load is what the load left behind
    warm_up(client, name, prompts, args.slots * want, args.max_tokens)
    pids = ({rid: pid for rid, (_, pid) in replicas(base, want).items()} if ray else {None: proc.pid})
    rss_before = rss_mb(pids.values())
    load_start = time.monotonic()
    killed: dict = {}

    def kill():
        rid, _, pid = scrape(base)
        killed.update(replica=rid, pid=pid, at_s=time.monotonic() - load_start, clock=time.strftime("%H:%M:%S"))
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(args.kill_replica_at, kill) if args.kill_replica_at is not None else None
    print(time.strftime("%H:%M:%S") + f" load: {args.clients} clients for {args.seconds:.0f} s", flush=True)
    load_clock = time.strftime("%H:%M:%S")
    records, load_seconds, still_open = closed_loop(client, name, prompts, args.clients, args.seconds,
                                                    args.max_tokens, args.seed, args.timeout, timer=timer)
    end_clock = time.strftime("%H:%M:%S")
    print(end_clock + " load over", flush=True)
    alive = [p for p in pids.values() if psutil.pid_exists(p)]
    rss_load = rss_mb(alive) if len(alive) == len(pids) else None
    checks = {}
    if not args.no_checks:
        checks["leave_mid_stream"] = leave_mid_stream(base, name, len(pids))
        checks["overload"] = overload(client, name, args.slots * want + args.max_waiting + 8)
    if args.idle:
        time.sleep(args.idle)
    after = replicas(base, len(pids)) if ray else {None: ({}, proc.pid)}
    same = {rid: pid for rid, (_, pid) in after.items() if rid in pids and pid == pids[rid]}
    rss_after = rss_mb(same.values()) if same else None
    metrics = {rid: values for rid, (values, _) in after.items()}
    server_lines = list(proc.replica_lines)
    stop_server(proc, timeout=120)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype="float32").eval()
    reference = {}
    for i in sorted({r["prompt"] for r in records}):
        ids = tok([prompts[i]], return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=args.max_tokens, recguide_mode="ar", do_sample=False)
        reference[i] = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    ok = [r for r in records if r["status"] == "ok"]
    mismatched = [r for r in ok if r["text"] != reference[r["prompt"]]]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    gaps = [g for r in ok for g in r.get("gaps", [])]
    blocks = collections.Counter()
    for values in metrics.values():
        for key, v in values.items():
            if key.startswith("recguide_block_rounds_total{"):
                blocks[key.split('"')[1]] += v
    tokens = sum(len(tok(r["text"])["input_ids"]) for r in ok)
    result = {
        "command": "python eval/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
        "ray": ray, "replicas": args.replicas, "autoscale": args.autoscale,
        "threads_per_replica": args.threads_per_replica if ray else None,
        "requests": len(records), "finished": len(ok), "failed": len(records) - len(ok),
        "streaming": sum(r["stream"] for r in records), "clients_still_open": still_open,
        "greedy_equal_to_hf": len(ok) - len(mismatched), "greedy_mismatched": len(mismatched),
        "errors": dict(collections.Counter(r["error"][:160] for r in records if r["status"] != "ok")),
        "per_replica": dict(collections.Counter(str(r.get("replica")) for r in ok)),
        "failed_per_replica": dict(collections.Counter(str(r.get("replica")) for r in records
                                                       if r["status"] != "ok")),
        "failed_seconds_max": max((r["seconds"] for r in records if r["status"] != "ok"), default=None),
        "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "chunk_gap_s": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
        "mean_request_s": statistics.mean(r["seconds"] for r in ok) if ok else None,
        "output_tokens": tokens, "load_seconds": load_seconds, "tokens_per_s": tokens / load_seconds,
        "rss_mb": {"before": rss_before, "after_load": rss_load, "after": rss_after,
                   "ratio_load": rss_load / rss_before if rss_load else None,
                   "ratio": rss_after / rss_before if rss_after and len(same) == len(pids) else None,
                   "processes": len(pids), "same_processes_after": len(same)},
        "killed": killed or None, "checks": checks, "load_clock": [load_clock, end_clock],
        "replica_lines": server_lines, "block_rounds": dict(blocks), "cpu": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    fine = not mismatched and not still_open and (killed or not result["failed"])
    return 0 if fine else 1


if __name__ == "__main__":
    raise SystemExit(main())
