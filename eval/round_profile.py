"""Where a round's time goes: model forwards vs. everything the engine does around them.

    python eval/round_profile.py --concurrency 1 16 --blocks 1 8 --out eval/results/round_profile.json

For each concurrency C (a static batch of C held-out prompts) and block size B (B = 1: plain decoding steps
inside the engine), LinearSS decodes `--tokens` new tokens per request while every engine phase is timed
with wall clocks around the engine's own methods; the time inside `Backbone.forward` is booked apart. HF's
plain greedy `generate` on the same batch gives the reference cost of one decoding step. Run it on an idle
machine: it times wall clock. (CPU: every op is synchronous, so the clocks measure the work; on CUDA they
would measure launches, so this script refuses a CUDA model.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prompts import load_mixed  # noqa: E402

from recguide_hf import branches  # noqa: E402
from recguide_hf.bench import save_run  # noqa: E402
from recguide_hf.cli import load  # noqa: E402
from recguide_hf.config import DecodingConfig  # noqa: E402
from recguide_hf.engine import Engine, SamplingSettings  # noqa: E402
from recguide_hf.models import as_backbone  # noqa: E402
from recguide_hf.stats import Stats  # noqa: E402

PHASES = ("plan", "draft", "branch_plan", "verify", "process", "accept", "commit", "reuse", "record", "plain")


class Clock:
    """Accumulates wall seconds per label. A timed call inside another (a `forward`, or the processor and the
    statistics inside a plain round) is booked apart from the phase that called it; a forward the prefill
    called is booked as `prefill_forward`."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.stack: list[str] = []

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                dt = time.perf_counter() - t0
                parent = self.stack[-1] if self.stack else None
                self.seconds["prefill_forward" if parent == "prefill" else label] += dt
                if parent is not None:
                    self.seconds[parent] -= dt
        return timed


class _TimedProcessor:
    """The engine calls `self.processor(...)`; a wrapper object is the way to time a `__call__`."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.call = inner, clock.wrap("process", inner.__call__)

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def run_engine(model, enc, block: int, max_new: int, eos: list[int], mode: str = "linear") -> dict:
    """LinearSS with block `block` (1: plain steps) on a static batch, every phase timed; `mode="recguide"`: the
    same with RecGuide's branches carried in every round (no cost table, so no rule drops them)."""
    clock = Clock()
    config = DecodingConfig(mode=mode, block_size=block)  # no cost table: no rule drops recguide's branches
    settings = SamplingSettings(max_new_tokens=max_new, eos_token_ids=eos, pad_token_id=model.config.pad_token_id)
    engine = Engine(as_backbone(model), config, settings)
    engine.backbone.forward = clock.wrap("forward", engine.backbone.forward)
    engine.policy.buckets = clock.wrap("plan", engine.policy.buckets)
    for phase, name in (("prefill", "_prefill"), ("draft", "_draft"), ("branch_plan", "_plan"),
                        ("verify", "_verify"), ("accept", "_accept"), ("commit", "_commit"),
                        ("plain", "_plain_round")):
        setattr(engine, name, clock.wrap(phase, getattr(engine, name)))
    engine.processor = _TimedProcessor(engine.processor, clock)
    reuse, record = branches.reuse, Stats.record_round
    branches.reuse, Stats.record_round = clock.wrap("reuse", reuse), clock.wrap("record", record)
    try:
        t0 = time.perf_counter()
        seqs, stats = engine.generate(enc["input_ids"], enc["attention_mask"])
        wall = time.perf_counter() - t0
    finally:
        branches.reuse, Stats.record_round = reuse, record
    sec = dict(clock.seconds)
    prefill = sec.pop("prefill", 0.0) + sec.pop("prefill_forward", 0.0)
    return {"wall": wall - prefill, "rounds": int(stats.rounds.max()), "seconds": sec,
            "new_tokens": int(stats.new_tokens.sum()), "sequences": seqs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", choices=["linear", "recguide"], default="linear",
                   help="recguide: branches ride in every round (where their host-side work goes)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32")
    if next(model.parameters()).device.type != "cpu":
        raise SystemExit("round_profile.py times wall clocks around asynchronous CUDA launches; run it on the CPU")
    prompts = load_mixed(max(args.concurrency))
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    results = []
    for c in args.concurrency:
        enc = tokenizer(prompts[:c], return_tensors="pt", padding=True)
        per = defaultdict(list)
        for _ in range(args.repeats):  # interleaved: every method once per repeat
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=1, do_sample=False, recguide_mode="ar")
            t1 = time.perf_counter()
            ref = model.generate(**enc, max_new_tokens=args.tokens, do_sample=False, recguide_mode="ar")
            per["hf"].append({"wall": time.perf_counter() - t1 - (t1 - t0)})  # decode steps, prefill taken off
            for b in args.blocks:
                run = run_engine(model, enc, b, args.tokens, eos, args.mode)
                assert torch.equal(run.pop("sequences")[:, :ref.shape[1]], ref), f"C={c} B={b}: output != HF greedy"
                per[b].append(run)
        hf_step = statistics.median(r["wall"] for r in per["hf"]) / (args.tokens - 1)
        row = {"C": c, "hf_ms_per_step": round(1e3 * hf_step, 2), "blocks": {}}
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
            }
        print(json.dumps(row), flush=True)
        results.append(row)
    save_run(args.out, {"results": results, "tokens": args.tokens, "repeats": args.repeats, "mode": args.mode})


if __name__ == "__main__":
    main()
