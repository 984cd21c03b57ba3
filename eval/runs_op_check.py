"""Closed-loop plain steps (B = 1) at C = 64: eager, compiled with the row-runs op (attention.py), and compiled reading
every row up to the longest (the layout before the op); a warm-up pass each, then 3 interleaved passes. Forward
seconds are booked apart for prefills and rounds.

    python eval/runs_op_check.py            # C = 64, B = 1 (the figures in attention.py's docstring)
    python eval/runs_op_check.py 32 4
"""

import sys
import time

import torch

import recguide_hf.compiled as comp  # noqa: E402
import recguide_hf.engine as eng  # noqa: E402
from recguide_hf.bench import run_engine  # noqa: E402
from recguide_hf.cli import load  # noqa: E402
from recguide_hf.config import DecodingConfig  # noqa: E402
from recguide_hf.prompts import load_mixed  # noqa: E402


def main():
    torch.set_grad_enabled(False)
    c = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    tok, model = load(None)
    prompts = load_mixed(c)[:2 * c]
    book, no_runs = {}, [False]
    run, adapt = eng.Engine._run, comp.CompiledForward.adapt

    def timed_run(self, prepared, ids, draft_mask=None, logits_to_keep=0):
        t0 = time.perf_counter()
        out = run(self, prepared, ids, draft_mask, logits_to_keep)
        kind = "prefill" if prepared[0].fresh else "round"
        book[kind] = book.get(kind, 0.0) + time.perf_counter() - t0
        return out

    def adapt_maybe_without_runs(self, cache):
        adapt(self, cache)
        if no_runs[0]:
            cache.row_runs = False
        return cache

    eng.Engine._run, comp.CompiledForward.adapt = timed_run, adapt_maybe_without_runs
    configs = {"eager": DecodingConfig(mode="linear", block_size=b),
               "compiled": DecodingConfig(mode="linear", block_size=b, compile=True),
               "compiled, no runs": DecodingConfig(mode="linear", block_size=b, compile=True)}
    results = {}
    for rep in range(4):  # the first pass of each compiles (untimed)
        for name, config in configs.items():
            no_runs[0] = name == "compiled, no runs"
            book.clear()
            r = run_engine(model, tok, prompts, c, 64, config)
            if rep:
                tokens = sum(len(x["new_ids"]) for x in r["records"])
                results.setdefault(name, []).append((tokens / r["wall"], dict(book)))
    for name, runs in results.items():
        print(f"{name}: tok/s {[round(t) for t, _ in runs]}, forward s "
              f"{[{k: round(v, 2) for k, v in seconds.items()} for _, seconds in runs]}")


if __name__ == "__main__":
    main()
