"""How much can ANY per-load choice of block size gain on an open-loop trace? (issue 45's third bar)

The bar asks recguide's mean per-request decoding speed on the bursty trace to reach x1.10 that of the best single
fixed method. This script measures the ceiling that choosing among the fixed methods by load can reach: a load
oracle that, every round, runs all requests in flight at the block size that the closed-loop simulation found
fastest at that many requests (eval/results/virtual_b200, nearest measured concurrency in log scale; 1 = a plain
step). It knows the answer the policy has to estimate, so it is an upper bound for a policy whose per-request values
add little beyond load (the closed loop: recguide within a few percent of the best fixed block at every C). It is
not a method users get, so it lives here and not in `recguide bench`.

    python eval/open_loop_ceiling.py                      # bursty:8,64,8 under the NLD-8B B200 cost table
    python eval/open_loop_ceiling.py --methods linear-8 linear-16 oracle recguide --out eval/results/open_loop_ceiling

Prints each method's open-loop figures (the same summary as `recguide bench --arrivals`) and the oracle's and
recguide's mean decoding speed and p99 TTFT against the best single fixed method; every output is checked against
HF greedy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from recguide_hf.core.policy import BlockPolicy
from recguide_hf.tools.bench import VirtualCosts, _engine_config, environment
from recguide_hf.tools.cli import load
from recguide_hf.tools.openloop import best_single_other, markdown_open, open_loop, parse_arrivals
from recguide_hf.tools.prompts import load_mixed

ROOT = Path(__file__).resolve().parent.parent


def best_by_load(bench_json: Path, key: str = "aggregate_tps") -> dict[int, int]:
    """{concurrency: block size of the fastest fixed method there (by `key`: aggregate or per-request tok/s; ar
    and linear-1 -> 1)}."""
    rows = json.loads(bench_json.read_text())["rows"]
    best: dict[int, tuple[float, int]] = {}
    for r in rows:
        m = r["method"]
        if m == "ar":
            block = 1
        elif m.startswith("linear-") and m[7:].isdigit():
            block = int(m[7:])
        else:
            continue
        c = r["concurrency"]
        if c not in best or r[key] > best[c][0]:
            best[c] = (r[key], block)
    return {c: b for c, (_, b) in sorted(best.items())}


class LoadOracle(BlockPolicy):
    """Every request in flight at the block the closed loop found fastest for that many requests."""

    def __init__(self, config, table: dict[int, int], steps: bool = False):
        super().__init__(config)
        self.table, self.steps = table, steps
        self.candidates = sorted(set(table.values()))
        self.max_block = max(self.candidates)

    def block_at(self, c: int) -> int:
        if self.steps:  # a table of thresholds (--table): the last C listed at or below c
            return self.table[max([k for k in self.table if k <= c] or [min(self.table)])]
        nearest = min(self.table, key=lambda k: (abs(math.log2(k) - math.log2(c)), k))
        return self.table[nearest]

    def plan(self, rows, pending_has, remaining=None):
        return torch.full_like(rows, self.block_at(rows.numel()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arrivals", default="bursty:8,64,8")
    p.add_argument("--virtual-costs", default=str(ROOT / "eval/costs/nld8b_b200.json"))
    p.add_argument("--closed-loop", default=str(ROOT / "eval/results/virtual_b200/bench.json"),
                   help="the closed-loop simulation whose fastest fixed method per C the oracles follow")
    p.add_argument("--methods", nargs="+", default=["linear-8", "linear-16", "oracle", "oracle-per-request"],
                   help="fixed methods, recguide, and the oracles: `oracle` follows the fastest fixed block per C by "
                        "aggregate tok/s, `oracle-per-request` by per-request tok/s (what decoding speed measures)")
    p.add_argument("--table", action="append", default=[], metavar="C:B,C:B,...",
                   help="an oracle of your own (method `table-N`, N counting from 1): block B from C requests in "
                        "flight up to the next C listed, e.g. 1:16,16:8,48:4")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    tables = {"oracle": best_by_load(Path(args.closed_loop)),
              "oracle-per-request": best_by_load(Path(args.closed_loop), "per_request_tps")}
    for i, spec in enumerate(args.table, 1):
        tables[f"table-{i}"] = {int(c): int(b) for c, b in (pair.split(":") for pair in spec.split(","))}
    for name, table in tables.items():
        print(f"{name}: block by concurrency (closed loop):", table)
    arrivals, trace = parse_arrivals(args.arrivals, 0)
    virtual = VirtualCosts(args.virtual_costs)
    tmp = Path(args.out or "/tmp/open_loop_ceiling")
    tmp.mkdir(parents=True, exist_ok=True)
    virtual_table = tmp / "virtual_cost_table.json"
    virtual_table.write_text(json.dumps(virtual.cost_table(), indent=1) + "\n")
    env = environment(" ".join(["python", "eval/open_loop_ceiling.py", *(argv or sys.argv[1:])]))
    tokenizer, model = load(None, "fp32", "cpu")
    plain = load(None, "fp32", "cpu", draft_adapter=False)[1]
    prompts = load_mixed((args.pool + 1) // 2)[: args.pool]
    policies = {}
    for name, table in tables.items():
        method = f"linear-{max(table.values())}"
        policies[name] = (method, LoadOracle(_engine_config(method, model.generation_config), table,
                                             name.startswith("table-")))
    rows = open_loop(model, tokenizer, prompts, args.methods, arrivals, args.max_new_tokens, args.slots,
                     reference_model=plain, virtual=virtual, virtual_table=str(virtual_table),
                     policies=policies)["rows"]
    for r in rows:
        print(r["method"], {k: r[k] for k in ("finished", "decode_speed_mean", "ttft_p99", "equal_to_ar")})
    print(markdown_open(rows))
    fixed = [r for r in rows if r["method"] not in (*tables, "recguide")]
    for ours in (*tables, "recguide"):
        if any(r["method"] == ours for r in rows) and fixed:
            best = best_single_other(fixed + [r for r in rows if r["method"] == ours], ours)
            us = next(r for r in rows if r["method"] == ours)
            print(f"{ours} / {best['method']} (best single fixed method here): decoding speed "
                  f"x{us['decode_speed_mean'] / best['decode_speed_mean']:.3f}, p99 TTFT "
                  f"x{us['ttft_p99'] / best['ttft_p99']:.3f}")
    if args.out:
        (tmp / "ceiling.json").write_text(json.dumps({"rows": rows, "oracle_tables": tables, "trace": trace,
                                                      "environment": env, "settings": vars(args)}, indent=1) + "\n")
        (tmp / "ceiling.md").write_text(f"Command: `{env['command']}`\n\n" + markdown_open(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
