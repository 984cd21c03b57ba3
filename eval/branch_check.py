"""Do RecGuide's branches pay on this machine? The measurement behind the cost rule's verdict (policy.py).

    python eval/branch_check.py --out eval/results/branch_check.json

A branch round carries S segments of B draft tokens per request in its verify forward and saves the next
round's draft forward where a branch came true (docs/algorithm.md §2.2). It pays iff

    coverage * T_draft  >  T_verify(S) - T_verify(0)

(coverage: the share of rounds whose next block a branch supplied). For each C and B this script measures
both sides on this machine and the result they add up to:
* serving (the bench's closed loop over its HumanEval and Shakespeare prompts, C slots, greedy): RecGuide at a
  fixed B with branches always carried (no cost table, so the rule cannot drop them), interleaved with
  LinearSS at the same B, `--repeats` times: hit rate of each branch kind, coverage, segments per row, and the
  paired throughput ratio (median); every output of both is checked token for token against plain HF greedy at
  batch 1;
* forwards (profile.py's timer over a prefix of `--prefix` tokens, interleaved passes, medians): the draft
  forward, the verify forward of B tokens, the same with S = 1, 2, 3 segments routed through the drafting
  adapter (what serving runs), and the same token count with no adapter, read at the segments per row serving
  carried (linear between the timed S), so the extra cost splits into extra tokens and the adapter's routing.
The break-even coverage is extra / T_draft; the paper reports about 75% of rounds hit on NLD-8B
(docs/algorithm.md §2.2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from recguide_hf.core.compiled import CompiledForward
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.masks import block_intra, causal_intra
from recguide_hf.models.registry import as_backbone
from recguide_hf.tools.bench import run_engine, run_hf, save_run, summarize
from recguide_hf.tools.cli import load
from recguide_hf.tools.profile import _forward_timer, interleaved_medians
from recguide_hf.tools.prompts import load_mixed


@torch.no_grad()
def forward_costs(model, c: int, block: int, prefix: int, repeats: int, compiled: bool = False) -> dict:
    """Median seconds of the forwards a branch round trades, at c rows over a `prefix`-token cache: the draft, the
    verify of B tokens, and for S = 1..3 segments the verify routed as serving runs it and the same token count
    without the adapter. `compiled`: through `recguide_compile`'s compiled forward (the untimed first pass of
    `interleaved_medians` compiles each)."""
    backbone = as_backbone(model)
    device = backbone.device
    cache = backbone.new_cache(c, prefix + block * 5)
    cache.lengths[:] = prefix
    rows = torch.arange(c, device=device)
    forward = CompiledForward(backbone) if compiled else None
    if forward is not None:  # the cache layout a compiled engine serves with
        forward.adapt(cache)

    def timer(q, intra, draft_from=None):
        return _forward_timer(backbone, cache, rows, q, intra, draft_from, forward)

    timers = {"draft": timer(block, block_intra(c, block, device), 0),
              "verify": timer(block, causal_intra(c, block, device))}
    for s in (1, 2, 3):
        wide = block * (1 + s)
        timers[f"branches_{s}"] = timer(wide, causal_intra(c, wide, device), block)
        timers[f"no_adapter_{s}"] = timer(wide, causal_intra(c, wide, device))
    return interleaved_medians(timers, repeats)


def at(costs: dict, kind: str, segments: float) -> float:
    """`kind`'s seconds at a fractional number of segments per row (linear between the timed 1, 2, 3)."""
    s = min(max(segments, 1.0), 3.0)
    lo = min(int(s), 2)
    return costs[f"{kind}_{lo}"] + (s - lo) * (costs[f"{kind}_{lo + 1}"] - costs[f"{kind}_{lo}"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="recguide_hf/bundled/recguide-tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix", type=int, default=160, help="cached tokens for the forward timings (the bench's "
                                                           "prompts are about 150 tokens)")
    p.add_argument("--forward-repeats", type=int, default=9)
    p.add_argument("--device", default="cpu", help="e.g. cuda: where a forward is memory-bound, extra query tokens "
                                                   "are nearly free and the break-even falls")
    p.add_argument("--compile", action="store_true", help="both methods and the forward timings through "
                   "recguide_compile's compiled forward (its warm-up untimed): what branches cost once the framework "
                   "overhead of their routing is compiled away")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tokenizer, model = load(args.model, "fp32", args.device)
    prompts = load_mixed((args.num_prompts + 1) // 2)[:args.num_prompts]
    plain = load(args.model, "fp32", args.device, draft_adapter=False)[1]  # the verifier alone, as the bench's HF rows
    reference = {i: run_hf(plain, tokenizer, [p], 1, args.max_new_tokens)["records"][0]["new_ids"]
                 for i, p in enumerate(tqdm(prompts, desc="HF greedy reference"))}
    results = []
    cases = [(c, b) for c in args.concurrency for b in args.blocks]
    with tqdm(total=len(cases) * args.repeats * 2, desc="branch check") as bar:
        for c, b in cases:
            configs = {"linear": DecodingConfig(mode="linear", block_size=b, compile=args.compile),
                       "branches": DecodingConfig(mode="recguide", block_size=b, cost_table=None, compile=args.compile)}
            runs = {k: [] for k in configs}
            if args.compile:  # an untimed pass of each compiles every shape it needs
                for k in configs:
                    run_engine(model, tokenizer, prompts, c, args.max_new_tokens, configs[k])
            for rep in range(args.repeats):
                for k in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
                    runs[k].append(run_engine(model, tokenizer, prompts, c, args.max_new_tokens, configs[k]))
                    bar.update(1)
            summaries = {k: [summarize(r, reference) for r in v] for k, v in runs.items()}
            served = summaries["branches"][-1]
            ratios = [x["aggregate_tps"] / y["aggregate_tps"] for x, y in zip(summaries["branches"],
                                                                                 summaries["linear"])]
            policies = [r["engine"].policy for r in runs["branches"]]  # mean branch segments per row and round
            segments = statistics.mean(q.segments_seen / q.segment_rows for q in policies)
            costs = forward_costs(model, c, b, args.prefix, args.forward_repeats, args.compile)
            routed = at(costs, "branches", segments)  # the verify forward with its segments, as serving runs it
            extra, routing = routed - costs["verify"], routed - at(costs, "no_adapter", segments)
            results.append({
                "concurrency": c, "block": b, "hit_rates": served["hit_rates"], "coverage": served["coverage"],
                "tau": served["tau"], "tpf": served["tpf"], "segments_per_row": segments, "costs_s": costs,
                "extra_s": extra, "routing_s": routing,
                "break_even_coverage": extra / costs["draft"],
                "throughput_ratio_runs": ratios, "throughput_ratio": statistics.median(ratios),
                "same_output": all(s["equal_to_ar"] for v in summaries.values() for s in v),
            })
            r = results[-1]
            tqdm.write(f"C={c} B={b}: coverage {r['coverage']:.2f} (break-even {r['break_even_coverage']:.2f}), "
                       f"branches / linear x{r['throughput_ratio']:.2f}, same output {r['same_output']}")
    payload = {"results": results, "settings": vars(args)}
    save_run(Path(args.out) if args.out else None, payload)
    print(markdown(payload))
    return 0


def break_even_without_routing(result: dict) -> float:
    """The coverage a branch round would need if the adapter's per-token routing cost nothing."""
    return (result["extra_s"] - result["routing_s"]) / result["costs_s"]["draft"]


def markdown(payload: dict) -> str:
    """The table docs/how-it-works.md shows (eval/update_readme.py)."""
    lines = ["| C | B | hits: correction 1 / 2 / continuation | segments per row | coverage | break-even coverage "
             "(without routing) | extra verify ms (routing) | draft ms | branches / LinearSS | same output |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        h, draft = r["hit_rates"], r["costs_s"]["draft"]
        hits = " / ".join(f"{h[k]:.0%}" for k in ("correction_1", "correction_2", "continuation"))
        free = break_even_without_routing(r)
        lines.append(f"| {r['concurrency']} | {r['block']} | {hits} | {r['segments_per_row']:.1f} "
                     f"| {r['coverage']:.0%} | {r['break_even_coverage']:.0%} ({free:.0%}) | {r['extra_s'] * 1e3:.1f} "
                     f"({r['routing_s'] * 1e3:.1f}) | {draft * 1e3:.1f} | x{r['throughput_ratio']:.2f} "
                     f"| {'yes' if r['same_output'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
