"""Run lm-eval tasks as `ar` (plain HF greedy) and as RecGuide; report identical responses and the time ratio.

Both modes run through `lm_eval.simple_evaluate(..., log_samples=True)` on one loaded model (the same lm-eval
batches, padding and stop criteria), one task at a time, modes alternating per repeat. Responses are compared
per document as strings and, re-tokenized, with the token_parity metric (eval/metrics/token_parity).

    python eval/lm_eval_parity.py --model recguide_hf/bundled/recguide-tiny --limit 16 \
        --json eval/results/lm_eval_parity.json

`--backend recguide` (default) uses recguide_hf.integrations.lm_eval_backend: it honours the tasks'
`max_gen_toks` and reports TPF / tau; `--backend hf` is lm-eval's stock backend (what `lm_eval --model hf` runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE / "tasks"
TOKEN_PARITY = HERE / "metrics" / "token_parity"
DEFAULT_TASKS = ("recguide_stdlib_nextline", "recguide_shakespeare_nextline")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="recguide_hf/bundled/recguide-tiny", help="model folder")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    parser.add_argument("--limit", type=int, default=16, help="documents per task (0 = all)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", choices=("recguide", "hf"), default="recguide")
    parser.add_argument("--mode", default="recguide", help="RecGuide mode compared with ar: recguide or linear")
    parser.add_argument("--gen-kwargs", default="", help="extra gen kwargs for the RecGuide run, e.g. "
                        "recguide_block_size=8")
    parser.add_argument("--repeats", type=int, default=1, help="timing repeats (median); responses from the first")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser.parse_args(argv)


def parse_kv(text: str) -> dict:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def load_lm(args):
    if args.backend == "recguide":
        from recguide_hf.integrations.lm_eval_backend import RecGuideLM

        return RecGuideLM(pretrained=args.model, device=args.device, batch_size=args.batch_size)
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=args.model, trust_remote_code=True, device=args.device, batch_size=args.batch_size)


def run_once(lm, task_manager, task: str, gen_kwargs: dict, limit: int | None):
    import lm_eval

    if hasattr(lm, "recguide_calls"):
        lm.recguide_calls, lm.recguide_requests = [], []
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, gen_kwargs=dict(gen_kwargs),
                                      log_samples=True, task_manager=task_manager, bootstrap_iters=0,
                                      verbosity="WARNING")
    seconds = time.perf_counter() - start
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    metrics = {k.split(",")[0]: v for k, v in results["results"][task].items()
               if k.endswith(",none") and "stderr" not in k}
    stats = results["config"].get("recguide_stats")
    return {"seconds": seconds, "responses": [s["resps"][0][0] for s in samples], "metrics": metrics,
            "generate_seconds": stats["generate_seconds"] if stats else None,
            "stats": {k: stats[k] for k in ("tpf", "tau", "acceptance", "generated_tokens") if k in stats}
            if stats and stats.get("requests") else None}


def warm_up(lm, modes: dict):
    """One short generation per mode, so one-time costs (first forward, allocations) fall outside the timing."""
    import torch

    enc = lm.tokenizer(["def main():\n    return", "King Lear.\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        for gen_kwargs in modes.values():
            lm.model.generate(input_ids=enc.input_ids.to(lm.device), attention_mask=enc.attention_mask.to(lm.device),
                              max_new_tokens=8, do_sample=False, **gen_kwargs)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def compare(lm, parity, ar: list[str], rg: list[str]) -> dict:
    tok = lambda s: lm.tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    token_parity = parity.compute(predictions=[tok(s) for s in rg], references=[tok(s) for s in ar])
    diffs = [{"doc": i, "ar": a, "recguide": r} for i, (a, r) in enumerate(zip(ar, rg)) if a != r]
    return {"docs": len(ar), "identical": len(ar) - len(diffs), "token_parity": token_parity, "differences": diffs[:5]}


def environment() -> dict:
    import lm_eval
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
    except OSError:
        commit = ""
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "lm_eval": getattr(lm_eval, "__version__", "0.4.13"), "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "git_commit": commit}


def main(argv=None):
    args = parse_args(argv)
    import evaluate
    from lm_eval.tasks import TaskManager

    lm = load_lm(args)
    task_manager = TaskManager(include_path=str(TASKS_DIR))
    parity = evaluate.load(str(TOKEN_PARITY))
    limit = args.limit or None
    modes = {"ar": {"recguide_mode": "ar"}, args.mode: {"recguide_mode": args.mode, **parse_kv(args.gen_kwargs)}}
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": args.model,
              "backend": args.backend, "limit": limit, "batch_size": args.batch_size, "gen_kwargs": modes,
              "environment": environment(), "tasks": {}}
    warm_up(lm, modes)
    for task in args.tasks:
        runs = {name: [] for name in modes}
        for _ in range(args.repeats):
            for name, gen_kwargs in modes.items():  # alternate, so machine drift hits both modes alike
                runs[name].append(run_once(lm, task_manager, task, gen_kwargs, limit))
                print(f"{task} {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
        ar, rg = runs["ar"][0], runs[args.mode][0]
        entry = compare(lm, parity, ar["responses"], rg["responses"])
        entry.update({
            "seconds": {name: median([r["seconds"] for r in rs]) for name, rs in runs.items()},
            "generate_seconds": {name: median([r["generate_seconds"] for r in rs])
                                 for name, rs in runs.items() if rs[0]["generate_seconds"] is not None},
            "metrics": {name: rs[0]["metrics"] for name, rs in runs.items()},
            "recguide_stats": rg["stats"],
        })
        entry["time_ratio"] = entry["seconds"][args.mode] / entry["seconds"]["ar"]
        report["tasks"][task] = entry

    print_table(report, args.mode)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return report


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(report: dict, mode: str) -> str:
    """The report as a Markdown table (also used by eval/update_readme.py)."""
    head = (f"| task | docs | identical responses | token exact | ar s | {mode} s | {mode}/ar time | "
            f"exact_match ar / {mode} | TPF | tau |")  # TPF / tau: only the recguide backend reports them
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for task, e in report["tasks"].items():
        em = e["metrics"]
        stats = e["recguide_stats"] or {}
        lines.append(f"| {task} | {e['docs']} | {e['identical']}/{e['docs']} | "
                     f"{e['token_parity']['exact_match']:.3f} | {e['seconds']['ar']:.1f} | {e['seconds'][mode]:.1f} | "
                     f"{e['time_ratio']:.2f} | {em['ar'].get('exact_match', 0):.3f} / "
                     f"{em[mode].get('exact_match', 0):.3f} | {_num(stats.get('tpf'))} | {_num(stats.get('tau'))} |")
    return "\n".join(lines)


def print_table(report: dict, mode: str):
    print(table(report, mode))


if __name__ == "__main__":
    main()
