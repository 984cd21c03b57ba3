"""Where a closed loop's time goes at the cost table's prices: while prompts wait for a slot (every slot busy) and in
the drain (from the step that admits the last prompt: the last requests finishing with fewer rows), per engine
method.

`recguide bench`'s closed loop runs max(2 C, 16) requests through C slots and divides all their tokens by all the
time, the drain included. Plain steps keep every slot in step (requests admitted together finish together); a run that
drafts finishes its requests at scattered rounds, so its last requests finish with the batch emptying around them
(`Engine.serve` plans them as one static batch, done with its slowest).
This prices both phases by the cost table the policy plans with (`CostTable.price`, decode rounds only: prefills are
left out), so the host's noise is out of the comparison, and checks every output against HF greedy.

    python eval/closed_loop_drain.py --concurrency 32 --prompts-per-slot 2 6 --repeats 3 \
        --out eval/results/closed_loop_drain.json
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.models.registry import as_backbone
from recguide_hf.tools.bench import _engine_config, pricing_table, run_hf, save_run
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_mixed


def run(model, tokenizer, ids: list[list[int]], slots: int, method: str, max_new: int, costs) -> tuple[dict, list]:
    """One closed loop (`Engine.serve`) of `ids` through `slots` slots: tokens, table seconds and block mix (rows) of
    the steps while prompts wait for a slot ("full") and of those from the one admitting the last prompt on ("drain",
    where `serve` plans the requests in flight as one static batch); and every request's new tokens."""
    gen = model.generation_config
    eos = gen.eos_token_id
    settings = SamplingSettings(max_new_tokens=max_new, eos_token_ids=[eos] if isinstance(eos, int) else list(eos),
                                pad_token_id=tokenizer.pad_token_id)
    engine = Engine(as_backbone(model), _engine_config(method, gen), settings,
                    base_dir=getattr(model.config, "_name_or_path", None))
    phases = {p: {"tokens": 0, "table_s": 0.0, "rows_by_block": collections.Counter()} for p in ("full", "drain")}
    counted = collections.Counter()

    def on_step(emissions):
        # `serve` set whole_batch before this step: from the step admitting the last prompt on, the drain
        phase = phases["drain" if engine.policy.whole_batch else "full"]
        phase["tokens"] += sum(len(e.new_ids) for e in emissions)
        now = engine.slots.stats.bucket_rounds
        ran = {k: n - counted[k] for k, n in now.items() if n != counted[k]}  # this step's bucket rounds
        counted.update(ran)
        phase["table_s"] += costs.price(ran)
        for (rows, block), n in ran.items():
            phase["rows_by_block"][block] += rows * n

    records = engine.serve(ids, slots, on_step=on_step)
    out = {"tokens": sum(p["tokens"] for p in phases.values()), "table_s": sum(p["table_s"] for p in phases.values())}
    out["table_tok_s"] = out["tokens"] / out["table_s"]
    for name, p in phases.items():
        out[name] = {"tokens": p["tokens"], "table_s": p["table_s"],
                     "table_tok_s": p["tokens"] / p["table_s"] if p["table_s"] else None,
                     "rows_by_block": dict(sorted(p["rows_by_block"].items()))}
    return out, [r["new_ids"] for r in records]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32])
    ap.add_argument("--prompts-per-slot", type=int, nargs="+", default=[2, 6])
    ap.add_argument("--methods", nargs="+", default=["linear-1", "linear-8", "recguide"])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method (fixed blocks price alike every run)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(None, "fp32")
    plain = load(None, "fp32", draft_adapter=False)[1]  # HF greedy on the verifier alone, as `recguide bench`
    costs = pricing_table(model)
    prompts = load_mixed(200)
    n_max = max(max(args.concurrency) * max(args.prompts_per_slot), 16)
    if n_max > len(prompts):
        raise SystemExit(f"{n_max} prompts asked for, {len(prompts)} held out")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[:n_max]]
    reference = [run_hf(plain, tokenizer, [p], 1, args.max_new_tokens)["records"][0]["new_ids"]
                 for p in prompts[:n_max]]
    results = []
    for c in args.concurrency:
        for per in args.prompts_per_slot:
            n = max(per * c, 16)
            for rep in range(args.repeats):
                for m in args.methods:
                    r, new = run(model, tokenizer, ids[:n], c, m, args.max_new_tokens, costs)
                    r.update(method=m, concurrency=c, prompts=n, repeat=rep, equal_to_hf_greedy=new == reference[:n])
                    results.append(r)
                    print(f"C={c} {n} prompts {m:10s} table {r['table_tok_s']:7.1f} tok/s | " + " | ".join(
                        f"{p}: {r[p]['tokens']} tok at {r[p]['table_tok_s'] or 0:.0f} tok/s {r[p]['rows_by_block']}"
                        for p in ("full", "drain")) + f" | = HF greedy: {r['equal_to_hf_greedy']}", flush=True)
    save_run(args.out, {"settings": vars(args) | {"out": str(args.out)}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
