"""Where closed-loop serving time goes: admissions (prompt prefill) vs. decoding rounds vs. the policy.

    python eval/serve_profile.py --concurrency 4 32 --methods linear-1 linear-8 recguide \
        --out eval/results/serve_profile.json

`recguide bench` serves C slots closed loop (a finished request's slot takes the next prompt); this script runs
the same loop (`recguide_hf.bench.run_engine`, the bench's prompts and request counts) with wall clocks around
the engine's admission (`Engine._admit`: cache reset and the prefill forwards), every backbone forward, the
block policy's plan and the certainty signal. Methods are interleaved, their order rotating between repeats;
figures are medians. Every output is checked against plain HF greedy at batch 1. Run it on an idle CPU
(it times wall clock; on CUDA the clocks would measure launches, so it refuses a CUDA model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from recguide_hf import engine as engine_module  # noqa: E402
from recguide_hf.bench import run_engine, run_hf, save_run  # noqa: E402
from recguide_hf.cli import load  # noqa: E402
from recguide_hf.models import as_backbone  # noqa: E402
from recguide_hf.policy import BlockPolicy  # noqa: E402
from recguide_hf.prompts import load_mixed  # noqa: E402

PARTS = ("admit", "forward", "admit_forward", "plan", "entropy")


class Clocks:
    """Wall seconds per part; a forward called from inside an admission is booked as `admit_forward`."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.admitting = False

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            admitting = self.admitting
            self.admitting = admitting or label == "admit"
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds["admit_forward" if label == "forward" and admitting else label] += \
                    time.perf_counter() - t0
                self.admitting = admitting

        setattr(owner, name, timed)
        return fn


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
    clocks = Clocks()
    originals = [(owner, name, clocks.wrap(owner, name, label)) for owner, name, label in (
        (engine_module.Engine, "_admit", "admit"), (type(as_backbone(model)), "forward", "forward"),
        (BlockPolicy, "plan", "plan"), (engine_module, "verifier_entropy", "entropy"))]
    results = []
    try:
        for c in args.concurrency:
            batch = prompts[: min(len(prompts), max(2 * c, args.min_prompts))]
            reference = [run_hf(model, tokenizer, [q], 1, args.tokens)["records"][0]["new_ids"] for q in batch]
            runs = defaultdict(list)
            for rep in range(args.repeats):
                order = args.methods[rep % len(args.methods):] + args.methods[:rep % len(args.methods)]
                for method in order:
                    clocks.seconds.clear()
                    run = run_engine(model, tokenizer, batch, c, args.tokens, method)
                    same = [r["new_ids"] for r in run["records"]] == reference
                    assert same, f"C={c} {method}: output != HF greedy"
                    tokens = sum(r["new_tokens"] for r in run["records"])
                    runs[method].append({"wall": run["wall"], "tokens_per_s": tokens / run["wall"],
                                         **{k: clocks.seconds.get(k, 0.0) for k in PARTS}})
            row = {"C": c, "requests": len(batch), "methods": {}}
            for method, rs in runs.items():
                med = {k: statistics.median(r[k] for r in rs) for k in ("wall", "tokens_per_s", *PARTS)}
                wall = med["wall"]
                row["methods"][method] = {
                    "tokens_per_s": round(med["tokens_per_s"], 1), "wall_s": round(wall, 3),
                    "admission_share": round(med["admit"] / wall, 3),
                    "round_forward_share": round(med["forward"] / wall, 3),
                    "policy_share": round((med["plan"] + med["entropy"]) / wall, 4),
                    "other_share": round(1 - (med["admit"] + med["forward"] + med["plan"] + med["entropy"]) / wall,
                                         3),
                    "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in rs]}
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    save_run(args.out, {"results": results, "tokens": args.tokens, "repeats": args.repeats})


if __name__ == "__main__":
    main()
