"""lm-eval through the HTTP endpoint: `local-completions` (with `num_concurrent`) against `recguide serve` and
against Ray Serve replicas, compared document by document with the in-process `hf` backend decoding RecGuide.

    python eval/lm_eval_endpoint.py --limit 8 --json eval/results/ray/lm_eval_endpoint.json

For each task: `--model hf` with `recguide_mode=recguide` in this process (the reference), then the same task
through each server, started on a free 127.0.0.1 port: what `lm_eval --model local-completions --model_args
model=NAME,base_url=http://127.0.0.1:PORT/v1/completions,num_concurrent=N,tokenizer=MODEL,tokenizer_backend=huggingface`
runs. Reports identical responses per task and the wall time of each (the servers' start-up and a first
warm-up run of the hf reference excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lm_eval_parity import DEFAULT_TASKS, TASKS_DIR, environment, run_once

from recguide_hf import BUNDLED_MODEL
from recguide_hf.testing.server import start_server, stop_server


def endpoint_lm(base: str, model: Path, num_concurrent: int):
    """lm-eval's `local-completions` model, as `--model local-completions --model_args ...` builds it."""
    from lm_eval.api.registry import get_model

    args = {"model": model.name, "base_url": base + "/v1/completions", "num_concurrent": num_concurrent,
            "tokenizer": str(model), "tokenizer_backend": "huggingface", "max_retries": 1, "timeout": 300}
    return get_model("local-completions").create_from_arg_string(",".join(f"{k}={v}" for k, v in args.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--num-concurrent", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2, help="Ray Serve replicas (0: skip the Ray endpoint)")
    p.add_argument("--batch-size", type=int, default=4, help="the hf reference's batch size")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASKS_DIR))
    gen = {"recguide_mode": "recguide"}
    report = {"command": "python eval/lm_eval_endpoint.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": str(args.model), "limit": args.limit, "num_concurrent": args.num_concurrent,
              "environment": environment(), "runs": {}}
    hf = HFLM(pretrained=str(args.model), trust_remote_code=True, device="cpu", batch_size=args.batch_size)
    run_once(hf, tasks, args.tasks[0], gen, 1)  # warm-up: the first generate's one-time costs stay out of the timing
    reference = {task: run_once(hf, tasks, task, gen, args.limit) for task in args.tasks}
    report["runs"]["hf (in process, recguide)"] = {t: {"seconds": r["seconds"], "metrics": r["metrics"]}
                                                 for t, r in reference.items()}
    del hf
    servers = {"recguide serve": ([], None, {})}
    if args.replicas:
        servers[f"recguide serve --replicas {args.replicas}"] = (
            ["--replicas", str(args.replicas), "--ray-cpus", str(os.cpu_count())], "Ray Serve replica",
            {"OMP_NUM_THREADS": "1"})
    for name, (flags, ready, env) in servers.items():
        proc, base = start_server(["--model", str(args.model), "--max-tokens", "256", *flags], timeout=600,
                                  env={**os.environ, **env}, ready_text=ready)
        try:
            lm = endpoint_lm(base, args.model, args.num_concurrent)
            entry = {}
            for task in args.tasks:
                start = time.perf_counter()
                run = run_once(lm, tasks, task, {}, args.limit)
                ref = reference[task]["responses"]
                diffs = [{"doc": i, "hf": a, "endpoint": b} for i, (a, b) in enumerate(zip(ref, run["responses"]))
                         if a != b]
                entry[task] = {"seconds": time.perf_counter() - start, "docs": len(ref),
                               "identical_to_hf": len(ref) - len(diffs), "differences": diffs[:3],
                               "metrics": run["metrics"]}
                print(f"{name} {task}: {entry[task]['identical_to_hf']}/{len(ref)} identical, "
                      f"{entry[task]['seconds']:.1f} s", flush=True)
            report["runs"][name] = entry
        finally:
            stop_server(proc, timeout=120)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    same = all(e["identical_to_hf"] == e["docs"] for run in list(report["runs"].values())[1:] for e in run.values())
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
