"""A load test of `recguide serve` over localhost: many clients at once, streaming and not, for a fixed time.

    python eval/serve_load.py --clients 32 --seconds 60 --out eval/results/serve_load.json

Starts the server (the bundled model unless --model) on a free local port, records its resident memory, runs
`--clients` threads with the `openai` client for `--seconds` (each picks a prompt and streaming or not from a
seeded stream, greedy, `--max-tokens`), then checks every response against plain HF greedy for its prompt,
records memory again after the load, and writes counts, client-side latencies (TTFT, chunk gaps) and the
server's /metrics block mix. Every request is accounted for: finished, failed (with its error) or still open
when the time ran out (the run waits for those, bounded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil

from recguide_hf import BUNDLED_MODEL
from recguide_hf.testing.server import start_server, stop_server
from recguide_hf.tools.prompts import load_mixed


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts (HumanEval and prose, interleaved)")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    prompts = load_mixed((args.prompts + 1) // 2)[: args.prompts]
    proc, base = start_server(["--model", str(args.model), "--slots", str(args.slots), "--max-waiting",
                               str(args.max_waiting)])
    server = psutil.Process(proc.pid)
    name = args.model.name
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
    client.completions.create(model=name, prompt=prompts[0], max_tokens=4, temperature=0)  # warm the path
    rss_before = server.memory_info().rss
    records, lock = [], threading.Lock()
    end = time.monotonic() + args.seconds

    def worker(k: int):
        rng = random.Random(args.seed * 1000 + k)
        while time.monotonic() < end:
            i, streaming = rng.randrange(len(prompts)), rng.random() < 0.5
            rec = {"prompt": i, "stream": streaming, "start": time.monotonic()}
            try:
                if streaming:
                    parts, times = [], []
                    for chunk in client.completions.create(model=name, prompt=prompts[i], max_tokens=args.max_tokens,
                                                           temperature=0, stream=True):
                        if chunk.choices and chunk.choices[0].text:
                            parts.append(chunk.choices[0].text)
                            times.append(time.monotonic())
                    rec["text"] = "".join(parts)
                    rec["ttft"] = times[0] - rec["start"] if times else None
                    rec["gaps"] = [b - a for a, b in zip(times, times[1:])]
                else:
                    out = client.completions.create(model=name, prompt=prompts[i], max_tokens=args.max_tokens,
                                                    temperature=0)
                    rec["text"] = out.choices[0].text
                rec["status"] = "ok"
            except Exception as err:  # noqa: BLE001 - every failure is counted and shown
                rec["status"], rec["error"] = "failed", repr(err)[:300]
            rec["seconds"] = time.monotonic() - rec["start"]
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.seconds + 600)
    still_open = sum(t.is_alive() for t in threads)
    metrics = httpx.get(base + "/metrics", timeout=10).text
    rss_after = server.memory_info().rss
    stop_server(proc, timeout=30)

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
    blocks = {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("recguide_block_rounds_total{")}
    result = {
        "command": "python eval/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
        "requests": len(records), "finished": len(ok), "failed": len(records) - len(ok),
        "streaming": sum(r["stream"] for r in records), "clients_still_open": still_open,
        "greedy_equal_to_hf": len(ok) - len(mismatched), "greedy_mismatched": len(mismatched),
        "errors": sorted({r["error"] for r in records if r["status"] != "ok"})[:5],
        "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "chunk_gap_s": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
        "mean_request_s": statistics.mean(r["seconds"] for r in ok) if ok else None,
        "rss_mb": {"before": rss_before / 2**20, "after": rss_after / 2**20, "ratio": rss_after / rss_before},
        "block_rounds": blocks, "cpu": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not result["failed"] and not mismatched and not still_open else 1


if __name__ == "__main__":
    raise SystemExit(main())
