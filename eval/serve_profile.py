"""Where closed-loop serving time goes: admissions (prompt prefill) vs. decoding rounds vs. the policy.

    python eval/serve_profile.py --concurrency 4 32 --methods linear-1 linear-8 recguide \
        --out eval/results/serve_profile.json

`recguide bench` serves C slots closed loop (a finished request's slot takes the next prompt); this script runs
the same loop (`recguide_hf.tools.bench.run_engine`, the bench's prompts and request counts) with the engine's timing
seam (`PhaseClock`, recguide_hf/core/phases.py) booking its admissions (cache reset and the prefill forwards), the
rounds' forwards, and the block policy's planning and learning. Methods are interleaved, their order rotating
between repeats; figures are medians. Every output is checked against plain HF greedy at batch 1. Run it on an idle CPU
(it times wall clock; on CUDA the clocks would measure launches, so it refuses a CUDA model).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from recguide_hf.core.phases import PhaseClock
from recguide_hf.tools.bench import run_engine, run_hf, save_run
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_mixed

PARTS = ("admit", "forward", "plan", "observe")


def parts(clock: PhaseClock) -> dict[str, float]:
    """Admissions (with their prefill forwards), the rounds' forwards, the policy's planning and learning."""
    rest = clock.by_phase(outside=("admit",))
    return {"admit": clock.total("admit"), "forward": rest.get("forward", 0.0), "plan": rest.get("plan", 0.0),
            "observe": rest.get("observe", 0.0)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 32])
    p.add_argument("--methods", nargs="+", default=["linear-1", "linear-8", "recguide"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=48, help="as `recguide bench`: at least this many requests")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32")
    if next(model.parameters()).device.type != "cpu":
        raise SystemExit("serve_profile.py times wall clocks around asynchronous CUDA launches; run it on the CPU")
    n_max = max(max(args.concurrency) * 2, args.min_prompts)
    prompts = load_mixed((n_max + 1) // 2)
    results = []
    for c in args.concurrency:
        batch = prompts[: min(len(prompts), max(2 * c, args.min_prompts))]
        reference = [run_hf(model, tokenizer, [q], 1, args.tokens)["records"][0]["new_ids"] for q in batch]
        runs = defaultdict(list)
        for rep in range(args.repeats):
            order = args.methods[rep % len(args.methods):] + args.methods[:rep % len(args.methods)]
            for method in order:
                clock = PhaseClock()
                run = run_engine(model, tokenizer, batch, c, args.tokens, method, phases=clock)
                same = [r["new_ids"] for r in run["records"]] == reference
                assert same, f"C={c} {method}: output != HF greedy"
                tokens = sum(r["new_tokens"] for r in run["records"])
                runs[method].append({"wall": run["wall"], "tokens_per_s": tokens / run["wall"],
                                     **parts(clock)})
        row = {"C": c, "requests": len(batch), "methods": {}}
        for method, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("wall", "tokens_per_s", *PARTS)}
            wall = med["wall"]
            row["methods"][method] = {
                "tokens_per_s": round(med["tokens_per_s"], 1), "wall_s": round(wall, 3),
                "admission_share": round(med["admit"] / wall, 3),
                "round_forward_share": round(med["forward"] / wall, 3),
                "policy_share": round((med["plan"] + med["observe"]) / wall, 4),
                "other_share": round(1 - (med["admit"] + med["forward"] + med["plan"] + med["observe"]) / wall,
                                     3),
                "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in rs]}
        print(json.dumps(row), flush=True)
        results.append(row)
    save_run(args.out, {"results": results, "tokens": args.tokens, "repeats": args.repeats})


if __name__ == "__main__":
    main()
