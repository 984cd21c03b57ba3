"""How plain and speculative decoding suffer when another process is busy on the same cores.

    python eval/contention.py --out eval/results/contention.json

For each torch thread count (`--threads`, default 2 and 1) and each condition (idle; a competing process
running 1-thread matrix products, started for the measurement and stopped after), the bundled model decodes
the same prompts with `recguide_mode="ar"` (HF's plain greedy) and `"recguide"` (default settings),
interleaved, `--repeats` times; medians. The slowdown factor is busy / idle seconds for the same mode and
thread count. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from recguide_hf.tools.bench import environment
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_prompts

COMPETITOR = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\n"
              "while True:\n    a = (a @ a).tanh()\n")


def time_modes(model, tokenizer, prompts, max_new: int, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"ar": [], "recguide": []}
    for _ in range(repeats):
        for mode in times:
            t0 = time.perf_counter()
            for p in prompts:
                model.generate(**tokenizer([p], return_tensors="pt"), max_new_tokens=max_new, do_sample=False,
                               recguide_mode=mode)
            times[mode].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32")
    prompts = load_prompts("humaneval", args.prompts)
    time_modes(model, tokenizer, prompts[:1], 8, 1)  # warm-up
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        idle = time_modes(model, tokenizer, prompts, args.max_new_tokens, args.repeats)
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR])
        try:
            time.sleep(2)
            busy = time_modes(model, tokenizer, prompts, args.max_new_tokens, args.repeats)
        finally:
            competitor.kill()
            competitor.wait()
        for mode in idle:
            rows.append({"threads": threads, "mode": mode, "idle_s": idle[mode], "busy_s": busy[mode],
                         "slowdown": busy[mode] / idle[mode]})
            print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, "settings": vars(args) | {"out": str(args.out)},
              "environment": environment("python " + " ".join(sys.argv))}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
