"""Refresh README.md's results section from the files the runs wrote (nothing typed by hand).

    python eval/update_readme.py

Reads eval/results/bench.md (+ its PNGs), eval/results/engine.json, model_cards/recguide-tiny/eval_results.json
and eval/results/lm_eval_parity.json when present, and rewrites the text between the results markers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
START, END = "<!-- results:start -->", "<!-- results:end -->"


def settings_line(bench: dict) -> str:
    st = bench["settings"]
    return (f"Settings: {st['max_new_tokens']} new tokens per request, concurrency "
            f"{', '.join(map(str, st['concurrencies']))}, {st['repeats']} repeats (medians), up to "
            f"{st['num_prompts']} prompts (HumanEval and held-out Shakespeare, mixed); greedy output of every "
            "method is compared with plain HF greedy at batch 1 (column `= AR`).")


def fastest(bench: dict) -> str:
    """One line computed from the bench run: the method with the highest aggregate tokens/s at each C."""
    rows = bench["rows"]
    best = {}
    for r in rows:
        c = r["concurrency"]
        if c not in best or r["aggregate_tps"] > best[c]["aggregate_tps"]:
            best[c] = r
    return "Fastest method at each concurrency in this run (aggregate tokens/s): " + ", ".join(
        f"C={c} {r['method']} ({r['aggregate_tps']:.0f})" for c, r in sorted(best.items())) + "."


def engine_section(path: Path) -> list[str]:
    e = json.loads(path.read_text())
    c1 = e["concurrency_1"]
    out = [f"Engine figures (`{e['environment']['command']}`; {e['environment']['hardware']}, commit "
           f"{e['environment']['git_commit']}): held-out code prompts (HumanEval), greedy, "
           f"{e['settings']['max_new_tokens']} new tokens, concurrency 1, methods interleaved per prompt.", "",
           "| method | TPF | tau | tokens/s (median) | branch rounds | hits: corr. 1 / corr. 2 / cont. (per round) "
           "| = HF greedy |", "|---|---|---|---|---|---|---|"]
    for m, r in c1.items():
        h = r["hit_rate"]
        hits = " / ".join(f"{h.get(k, 0):.0%}" for k in ("correction_1", "correction_2", "continuation"))
        out.append(f"| {m} | {r['tpf']:.2f} | {r['tau']:.2f} | {r['tokens_per_s_median']:.1f} | "
                   f"{r['branch_round_share']:.0%} | {hits} | {'yes' if r['equal_to_hf_greedy'] else 'NO'} |")
    for m in ("recguide-16", "recguide-16-costed"):
        r = c1[m]
        out.append("")
        out.append(f"* {m} vs linear-16: TPF x{r['tpf_vs_linear16']:.2f}, wall-clock tokens/s "
                   f"x{r['speed_vs_linear16_median_ratio']:.2f} (median of per-prompt ratios)")
    b = e["batched_c8"]
    out += ["", f"* batched LinearSS (B=16) at concurrency 8: {b['batched_s_median']:.1f} s vs "
            f"{b['one_at_a_time_s_median']:.1f} s one at a time (x{b['speedup']:.2f}); output = HF greedy: "
            f"{'yes' if b['equal_to_hf_greedy'] else 'NO'}"]
    return out


def main():
    readme = ROOT / "README.md"
    text = readme.read_text()
    res = ROOT / "eval" / "results"
    lines = [START, "## Results", ""]
    if (res / "bench.md").exists():
        bench = json.loads((res / "bench.json").read_text())
        lines += ["The concurrency frontier of the bundled model on this project's 2-core CPU: every method in one "
                  "run, closed loop, greedy (per-request vs aggregate tokens/s, points labelled by concurrency C). "
                  "Regenerate with `recguide bench` (add `--quick` for a 3-minute smoke run). These timings come "
                  "from a shared 2-core machine: compare ratios within one table, not across runs.", "",
                  "![frontier](eval/results/frontier.png)", "", settings_line(bench), "", fastest(bench), "",
                  (res / "bench.md").read_text().strip(), "",
                  "![TPF and tau](eval/results/tpf_tau.png)", ""]
    rho = res / "rho" / "bench.json"
    if rho.exists():
        from recguide_hf.bench import markdown_table

        r = json.loads(rho.read_text())
        lines += ["The cost weight rho of the adaptive policy, measured in one run "
                  f"(`{r['environment']['command']}`, commit {r['environment']['git_commit']}): `recguide:rho=0` "
                  "ignores cost, the default sets rho to the best fixed-block rate at that load, and "
                  "`recguide:block_size=4,overlap=off` is LinearSS with B=4, outside the policy's candidates.", "",
                  markdown_table(r), ""]
    if (res / "engine.json").exists():
        lines += engine_section(res / "engine.json") + ["", "Regenerate with the command above.", ""]
    parity = res / "lm_eval_parity.json"
    if parity.exists():
        sys.path.insert(0, str(ROOT / "eval"))
        from lm_eval_parity import table

        report = json.loads(parity.read_text())
        mode = next(m for m in report["gen_kwargs"] if m != "ar")
        lines += [f"lm-evaluation-harness, the same tasks as `ar` and as `{mode}` (`python eval/{report['command']}`, "
                  f"backend `{report['backend']}`, commit {report['environment']['git_commit']}):", "",
                  table(report, mode), ""]
    card = ROOT / "model_cards" / "recguide-tiny" / "eval_results.json"
    if card.exists():
        r = json.loads(card.read_text())
        he = r["linear_ss"]
        losses = ", ".join(f"held-out {c} AR loss {v['ar_loss']:.2f}" for c, v in r["heldout"].items())
        taus = ", ".join(f"B={k.split('_B')[1]}: {v['tau']:.2f}" for k, v in he.items() if k.startswith("humaneval"))
        lines += [f"The bundled model (details in its [model card](model_cards/recguide-tiny/README.md)): {losses}; "
                  f"LinearSS tau on HumanEval prompts {taus} (distinct-4-gram ratio "
                  f"{he['humaneval_B16']['distinct4']:.2f}).", ""]
    lines.append(END)
    block = "\n".join(lines)
    if START in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.replace("RESULTS_PLACEHOLDER", block)
    readme.write_text(text)
    print("README results section updated")


if __name__ == "__main__":
    main()
