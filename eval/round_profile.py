"""Where a round's time goes: model forwards vs. everything the engine does around them.

    python eval/round_profile.py --concurrency 1 16 --blocks 1 8 --out eval/results/round_profile.json
    python eval/round_profile.py --compile --concurrency 1 --blocks 1 8 16 --batches 16 \
        --out eval/results/round_profile_compiled.json

For each concurrency C (a static batch of C held-out prompts; `--batches K`: K such batches of other prompts, one
after the other, their times and tokens summed) and block size B (B = 1: plain decoding steps
inside the engine), LinearSS decodes `--tokens` new tokens per request while the engine's timing seam
(`Engine(phases=PhaseClock())`, recguide_hf/core/phases.py) times every phase; the forwards are booked apart. HF's
plain greedy `generate` on the same batch gives the reference cost of one decoding step. Run it on an idle
machine: it times wall clock. (CPU: every op is synchronous, so the clocks measure the work; on CUDA they
would measure launches, so this script refuses a CUDA model.)

`--compile` profiles `recguide_compile=true` against HF's compiled decoding (static cache + compiled forward,
the bench's `ar-compile`): one untimed pass of each per C compiles what the timed passes need (its seconds are
reported as `warmup_s`), and the forwards are booked through the engine's compiled forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.core.phases import PhaseClock
from recguide_hf.models.registry import as_backbone
from recguide_hf.tools.bench import ar_compile_kwargs, save_run
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_mixed

PHASES = ("plan", "draft", "branch_plan", "verify", "process", "accept", "commit", "reuse", "record", "observe",
          "plain")


def run_engine(model, enc, block: int, max_new: int, eos: list[int], mode: str = "linear",
               compile: bool = False) -> dict:
    """LinearSS with block `block` (1: plain steps) on a static batch, every phase timed through the engine's
    timing seam (recguide_hf/core/phases.py); `mode="recguide"`: the same with RecGuide's branches carried in every
    round (no cost table, so no rule drops them); `compile`: `recguide_compile=true` (its seconds spent compiling
    come back as `compile_s`)."""
    clock = PhaseClock()
    # no cost table: no rule drops recguide's branches
    config = DecodingConfig(mode=mode, block_size=block, compile=compile)
    settings = SamplingSettings(max_new_tokens=max_new, eos_token_ids=eos, pad_token_id=model.config.pad_token_id)
    engine = Engine(as_backbone(model), config, settings, phases=clock)
    t0 = time.perf_counter()
    seqs, stats = engine.generate(enc["input_ids"], enc["attention_mask"])
    wall = time.perf_counter() - t0
    prefill = clock.total("admit")  # the prefill with its forwards
    return {"wall": wall - prefill, "rounds": int(stats.rounds.max()), "seconds": clock.by_phase(outside=("admit",)),
            "new_tokens": int(stats.new_tokens.sum()), "sequences": seqs, "compile_s": engine.compile_warmup_s or 0.0}


def hf_generate(model, enc, max_new: int, compile: bool):
    """HF's greedy generate: plain (`recguide_mode="ar"`), or compiled as the bench's `ar-compile` runs it."""
    kw = ar_compile_kwargs() if compile else {}
    return model.generate(**enc, max_new_tokens=max_new, do_sample=False, recguide_mode="ar", **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, default=1,
                   help="static batches of C prompts each (different prompts), one after the other per repeat")
    p.add_argument("--mode", choices=["linear", "recguide"], default="linear",
                   help="recguide: branches ride in every round (where their host-side work goes)")
    p.add_argument("--compile", action="store_true",
                   help="recguide_compile=true against HF's compiled decoding (static cache + compiled forward)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32")
    if next(model.parameters()).device.type != "cpu":
        raise SystemExit("round_profile.py times wall clocks around asynchronous CUDA launches; run it on the CPU")
    prompts = load_mixed((max(args.concurrency) * args.batches + 1) // 2)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    results = []
    for c in args.concurrency:
        batches = [tokenizer(prompts[i * c:(i + 1) * c], return_tensors="pt", padding=True)
                   for i in range(args.batches)]
        per = defaultdict(list)
        warmup = {}
        if args.compile:  # untimed: compiles every shape the timed passes meet
            t0 = time.perf_counter()
            for enc in batches:
                hf_generate(model, enc, 1, True)
                hf_generate(model, enc, args.tokens, True)
            warmup["hf"] = round(time.perf_counter() - t0, 1)
            for b in args.blocks:
                warmup[b] = round(sum(run_engine(model, enc, b, args.tokens, eos, args.mode, True)["compile_s"]
                                      for enc in batches), 1)
        for _ in range(args.repeats):  # interleaved: every method once per repeat
            hf_wall, refs = 0.0, []
            for enc in batches:
                t0 = time.perf_counter()
                hf_generate(model, enc, 1, args.compile)
                t1 = time.perf_counter()
                refs.append(hf_generate(model, enc, args.tokens, args.compile))
                hf_wall += time.perf_counter() - t1 - (t1 - t0)  # decode steps, prefill taken off
            per["hf"].append({"wall": hf_wall})
            for b in args.blocks:
                total = {"wall": 0.0, "rounds": 0, "new_tokens": 0, "seconds": defaultdict(float)}
                for enc, ref in zip(batches, refs):
                    run = run_engine(model, enc, b, args.tokens, eos, args.mode, args.compile)
                    assert torch.equal(run.pop("sequences")[:, :ref.shape[1]], ref), f"C={c} B={b}: output != HF"
                    for key in ("wall", "rounds", "new_tokens"):
                        total[key] += run[key]
                    for key, sec in run["seconds"].items():
                        total["seconds"][key] += sec
                per[b].append(total)
        hf_step = statistics.median(r["wall"] for r in per["hf"]) / (args.tokens - 1) / args.batches
        row = {"C": c, "hf_ms_per_step": round(1e3 * hf_step, 2), "blocks": {}}
        if args.compile:
            row["warmup_s"] = warmup
        for b in args.blocks:
            runs = per[b]
            rounds = runs[0]["rounds"]
            wall = statistics.median(r["wall"] for r in runs)
            med = {k: statistics.median(r["seconds"].get(k, 0.0) for r in runs) for k in ("forward", *PHASES)}
            row["blocks"][b] = {
                "rounds": rounds, "ms_per_round": round(1e3 * wall / rounds, 2),
                "forward_ms_per_round": round(1e3 * med["forward"] / rounds, 2),
                "outside_share": round((wall - med["forward"]) / wall, 3),
                "phase_ms_per_round": {ph: round(1e3 * med[ph] / rounds, 3) for ph in PHASES},
                "tokens_per_round": round(runs[0]["new_tokens"] / c / rounds, 2),
                "step_vs_hf": round(wall / rounds / hf_step, 3) if b == 1 else None,
                # decode speed against HF's on the same batch (prefills taken off both): > 1 is faster than HF
                "speedup_vs_hf": round(runs[0]["new_tokens"] / c / wall * hf_step, 3),
            }
        print(json.dumps(row), flush=True)
        results.append(row)
    save_run(args.out, {"results": results, "tokens": args.tokens, "repeats": args.repeats, "mode": args.mode,
                        "compile": args.compile, "batches": args.batches})


if __name__ == "__main__":
    main()
