"""Engine figures for the project issues, measured in one run with methods interleaved.

    python eval/measure_engine.py --prompts 16 --out eval/results/engine.json

1. LinearSS on held-out code prompts (HumanEval), greedy, 128 new tokens: TPF and tau for B = 8, 16, 32.
2. Batched LinearSS (B=16) at concurrency 8 vs the same 8 requests one at a time (wall-clock ratio).
3. Overlap at concurrency 1, B = 16: RecGuide branches (always on, and gated by the bundled cost table) vs
   LinearSS: TPF, tokens/s (median of per-prompt ratios, methods interleaved per prompt), hits per kind.
Every method's output is compared token for token with plain HF greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

import recguide_hf
from recguide_hf.tools.bench import environment
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_prompts


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tok, model = load(args.model, "fp32")
    prompts = load_prompts("humaneval", args.prompts)
    n = args.max_new_tokens
    result = {"environment": environment("python " + " ".join(sys.argv)),
              "settings": vars(args) | {"out": str(args.out)}}

    refs = []
    for text in prompts:
        enc = tok([text], return_tensors="pt")
        refs.append(model.generate(**enc, max_new_tokens=n, recguide_mode="ar", do_sample=False))

    # 1 + 3: per prompt, interleave every method at concurrency 1
    methods = {"linear-8": dict(recguide_mode="linear", recguide_block_size=8),
               "linear-16": dict(recguide_mode="linear", recguide_block_size=16),
               "linear-32": dict(recguide_mode="linear", recguide_block_size=32),
               # "" = no cost table: branches ride in every verify forward
               "recguide-16": dict(recguide_mode="recguide", recguide_block_size=16, recguide_cost_table=""),
               "recguide-16-costed": dict(recguide_mode="recguide", recguide_block_size=16)}
    per = {m: {"tokens": 0, "forwards": 0, "rounds": 0, "times": [], "equal": True, "hits": {},
               "branch_rounds": 0} for m in methods}
    for i, text in enumerate(prompts):
        enc = tok([text], return_tensors="pt")
        order = list(methods)[i % len(methods):] + list(methods)[: i % len(methods)]
        for m in order:
            out, secs = timed(partial(recguide_hf.generate, model, **enc, max_new_tokens=n,
                                      return_dict_in_generate=True, **methods[m]))
            s = out.recguide_stats
            rec = per[m]
            rec["tokens"] += s["new_tokens"]
            rec["forwards"] += s["forwards"]
            rec["rounds"] += s["rounds"]
            rec["branch_rounds"] += s["branch_rounds"]
            rec["times"].append(secs / max(s["new_tokens"], 1))
            for k, v in s["hits"].items():
                rec["hits"][k] = rec["hits"].get(k, 0) + v
            rec["equal"] &= torch.equal(out.sequences, refs[i])
    summary = {}
    for m, rec in per.items():
        summary[m] = {"tpf": rec["tokens"] / rec["forwards"], "tau": rec["tokens"] / rec["rounds"],
                      "tokens_per_s_median": 1 / statistics.median(rec["times"]), "equal_to_hf_greedy": rec["equal"],
                      "hit_rate": {k: v / rec["rounds"] for k, v in rec["hits"].items()},
                      "branch_round_share": rec["branch_rounds"] / rec["rounds"]}
    base = per["linear-16"]["times"]
    for m in ("recguide-16", "recguide-16-costed"):
        ratios = [b / r for b, r in zip(base, per[m]["times"])]
        summary[m]["speed_vs_linear16_median_ratio"] = statistics.median(ratios)
        summary[m]["tpf_vs_linear16"] = summary[m]["tpf"] / summary["linear-16"]["tpf"]
    result["concurrency_1"] = summary

    # 2: batched LinearSS at C=8 vs one at a time, interleaved, 3 repeats
    batch = prompts[:8]
    enc8 = tok(batch, return_tensors="pt", padding=True)
    t_batched, t_single, equal = [], [], True
    for rep in range(3):
        def one_by_one():
            outs = []
            for text in batch:
                outs.append(recguide_hf.generate(model, **tok([text], return_tensors="pt"), max_new_tokens=n,
                                                 recguide_mode="linear", recguide_block_size=16))
            return outs
        def batched():
            return recguide_hf.generate(model, **enc8, max_new_tokens=n, recguide_mode="linear",
                                        recguide_block_size=16)
        for name, fn in ((("single", one_by_one), ("batched", batched)) if rep % 2 == 0 else
                         (("batched", batched), ("single", one_by_one))):
            out, secs = timed(fn)
            (t_single if name == "single" else t_batched).append(secs)
            if name == "batched":
                width = enc8["input_ids"].shape[1]
                for r, text in enumerate(batch):
                    ref = refs[r][0, len(tok(text)["input_ids"]):].tolist()
                    equal &= out[r, width:width + len(ref)].tolist() == ref
    result["batched_c8"] = {"batched_s_median": statistics.median(t_batched),
                            "one_at_a_time_s_median": statistics.median(t_single),
                            "speedup": statistics.median(t_single) / statistics.median(t_batched),
                            "equal_to_hf_greedy": equal}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
