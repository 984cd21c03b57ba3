"""Refresh README.md's results section from the files the runs wrote (nothing typed by hand).

    python eval/update_readme.py

Reads eval/results/bench.json / bench.md (+ its PNGs), eval/results/virtual_b200/bench.json (the simulation under
a GPU cost table), eval/results/round_profile*.json, serve_profile*.json,
engine.json, recguide_hf/bundled/recguide-tiny/eval_results.json and eval/results/lm_eval_parity.json when present, and
rewrites the text between the results markers, the speed sentence of the introduction (between the speed
markers), the compile note of the performance notes (between the compile markers), the round-time, serving-time
and branch tables of "How it works" (between the round, serve and branches markers), and the lm-eval parity table
of docs/lm_eval.md (between its parity markers).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
SPEED = ("<!-- speed:start -->", "<!-- speed:end -->")
ROUND = ("<!-- round:start -->", "<!-- round:end -->")
COMPILED_ROUND = ("<!-- compiled_round:start -->", "<!-- compiled_round:end -->")
SERVE = ("<!-- serve:start -->", "<!-- serve:end -->")
BRANCHES = ("<!-- branches:start -->", "<!-- branches:end -->")
COMPILE = ("<!-- compile:start -->", "<!-- compile:end -->")
PARITY = ("<!-- parity:start -->", "<!-- parity:end -->")  # docs/lm_eval.md
CARDS = ROOT / "model_cards"
BUNDLED = ROOT / "recguide_hf" / "bundled" / "recguide-tiny"


SERVING = ("<!-- serving:start -->", "<!-- serving:end -->")
POLICY = ("<!-- policy:start -->", "<!-- policy:end -->")


def policy_table(res: Path) -> str:
    """eval/policy_check.py's run (policy_check.json): the default policy against every fixed choice on held-out
    prompts, static batches, with and without the online value correction."""
    path = res / "policy_check.json"
    if not path.exists():
        return "(no policy check recorded yet)"
    run = json.loads(path.read_text())
    env = run["environment"]
    rows = run["results"]
    methods = list(rows[0]["tok_s"])
    lines = [f"Static batches of held-out HumanEval prompts (never used to calibrate), {rows[0]['prompts']} or C of "
             f"them per C in batches of C, {run['settings']['max_new_tokens']} new tokens, best of "
             f"{run['settings']['repeats']} interleaved runs, tokens/s (`{env['command']}`, {env['hardware']}, "
             f"commit {env['git_commit']}); `recguide-table` is the policy without the online value correction:", "",
             "| C | " + " | ".join(methods) + " | fastest other | recguide / it | = HF greedy |",
             "|---|" + "---|" * (len(methods) + 3)]
    for row in rows:
        same = all(v for m, v in row["equal_hf_greedy"].items() if m != "hf-ar")
        lines.append(f"| {row['C']} | " + " | ".join(f"{row['tok_s'][m]:.1f}" for m in methods)
                     + f" | {row['fastest_other']} | x{row['ratio_to_fastest']['recguide']:.2f} | "
                     + ("yes" if same else "NO") + " |")
    virtual = res / "virtual_b200_policy" / "bench.json"
    if virtual.exists():
        v = json.loads(virtual.read_text())
        by_c: dict[int, dict[str, dict]] = {}
        for r in v["rows"]:
            by_c.setdefault(r["concurrency"], {})[r["method"]] = r
        parts = []
        for c, rows_c in sorted(by_c.items()):
            others = {m: r["aggregate_tps"] for m, r in rows_c.items() if m != "recguide"}
            best = max(others, key=others.get)
            parts.append(f"C = {c}: x{rows_c['recguide']['aggregate_tps'] / others[best]:.2f} of {best}")
        same = all(r["equal_to_ar"] for r in v["rows"])
        lines += ["", f"Under the NLD-8B B200 cost table (a simulation, closed loop; `{v['environment']['command']}`, "
                  f"commit {v['environment']['git_commit']}): recguide against the best fixed method "
                  + ", ".join(parts) + "; every output = HF greedy: " + ("yes" if same else "NO") + "."]
    return "\n".join(lines)


def serving_results(res: Path) -> str:
    """The open-loop runs (`recguide bench --arrivals`, results in open_loop_*/) and the server's load test
    (eval/serve_load.py, serve_load.json), each with its command, as measured."""
    from recguide_hf.tools.openloop import describe, markdown_open, verdict

    parts = []
    for folder in sorted(res.glob("open_loop_*")):
        path = folder / "open_loop.json"
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        env, trace = run["environment"], run["trace"]
        where = ("a simulation: every forward priced by " + run["settings"]["virtual_costs"] + ", the arrival clock "
                 "simulated too" if run["settings"].get("virtual_costs") else f"wall time on {env['hardware']}")
        parts += [f"**Open loop, {describe(trace)}** ({where}; {len(trace['arrivals'])} requests, "
                  f"{run['settings']['max_new_tokens']} new tokens each, {run['settings']['slots']} rows; "
                  f"`{env['command']}`, commit {env['git_commit']}):", "", markdown_open(run["rows"]), ""]
        line = verdict(run["rows"])
        if line:
            parts += [line + ".", ""]
        for png in ("open_loop_in_flight.png", "open_loop_latency_cdf.png"):
            if (folder / png).exists():
                parts += [f"![{folder.name} {png[10:-4]}]({folder.relative_to(ROOT)}/{png})", ""]
    load = res / "serve_load.json"
    if load.exists():
        r = json.loads(load.read_text())
        parts += [f"**Load test of `recguide serve`** (`{r['command']}`): {r['clients']} clients for "
                  f"{r['seconds']:.0f} s, half streaming: {r['requests']} requests, {r['finished']} finished, "
                  f"{r['failed']} failed, {r['clients_still_open']} clients still open at the end; greedy responses "
                  f"equal to plain HF greedy: {r['greedy_equal_to_hf']} of {r['finished']}; client-side TTFT p50 "
                  f"{r['ttft_s']['p50']:.2f} s, p99 {r['ttft_s']['p99']:.2f} s; server memory "
                  f"{r['rss_mb']['before']:.0f} MB before, {r['rss_mb']['after']:.0f} MB after "
                  f"(x{r['rss_mb']['ratio']:.2f}).", ""]
    return "\n".join(parts).strip() or "(no serving runs recorded yet)"


def replace_between(text: str, markers: tuple[str, str], body: str, sep: str = "\n") -> str:
    start, end = markers
    if start not in text:
        raise SystemExit(f"no {start} marker to write between")
    head, rest = text.split(start, 1)
    return head + start + sep + body + sep + end + rest.split(end, 1)[1]


def speed_sentence(bench: dict) -> str:
    """Where RecGuide (default settings) is faster than plain AR decoding in the latest bench, and where not."""
    by = {(r["method"], r["concurrency"]): r for r in bench["rows"]}
    cs = sorted(c for m, c in by if m == "recguide" and ("ar", c) in by)
    ratio = {c: by[("recguide", c)]["aggregate_tps"] / by[("ar", c)]["aggregate_tps"] for c in cs}
    faster = [c for c in cs if ratio[c] >= 1.0]
    slower = [c for c in cs if ratio[c] < 1.0]
    env = bench["environment"]

    def span(group):
        return ", ".join(f"C={c} (x{ratio[c]:.2f})" for c in group)

    parts = []
    if faster:
        parts.append(f"RecGuide is faster than plain AR decoding at {span(faster)}")
    if slower:
        parts.append(("and slower at " if faster else "RecGuide is slower than plain AR decoding at ") + span(slower))
    best = {}  # the fastest other method at each C: what a user could have picked instead
    for c in cs:
        other = max((r for (m, cc), r in by.items() if cc == c and m != "recguide"), key=lambda r: r["aggregate_tps"])
        best[c] = (other["method"], by[("recguide", c)]["aggregate_tps"] / other["aggregate_tps"])
    behind = [c for c in cs if round(best[c][1], 2) < 0.97]  # as shown, two decimals
    peer = ("Against the fastest other method of the same run at each C it is at x"
            + ", ".join(f"{best[c][1]:.2f}" for c in cs) + " (C=" + ", ".join(map(str, cs)) + ")"
            + (", below x0.97 at " + ", ".join(f"C={c} ({best[c][0]})" for c in behind) if behind else "")
            + ". ")
    from recguide_hf.tools.bench import HF_AR, parse_method

    hf = {}  # HF's fastest autoregressive path at each C (plain, static cache, compiled, continuous batching)
    for c in cs:
        rows = [r for (m, cc), r in by.items() if cc == c and parse_method(m)[0] in HF_AR]
        if any(parse_method(r["method"])[0] != "ar" for r in rows):
            fast = max(rows, key=lambda r: r["aggregate_tps"])
            hf[c] = (fast, by[("recguide", c)]["aggregate_tps"] / fast["aggregate_tps"])
    if hf:
        warm = sorted({round(f["warmup_s"]) for f, _ in hf.values() if "warmup_s" in f})
        peer += ("Against HF's fastest autoregressive decoding at each C (the best of plain `generate`, static cache, "
                 "static cache + compiled forward and continuous batching) it is at x"
                 + ", ".join(f"{hf[c][1]:.2f} ({hf[c][0]['method']})" for c in sorted(hf))
                 + (f", the compiled forward's warm-up ({warm[0]}-{warm[-1]} s per C) left out of its timing"
                    if warm else "") + ". ")
    lossless = all(r["equal_to_ar"] for r in bench["rows"])
    share = max(by[("recguide", c)].get("branch_round_share", 0.0) for c in cs)
    branches = ("Its branches (next-round drafts inside the verify forward) rode in no round at any C: the cost rule "
                "found they do not pay on this machine (\"How it works\" shows the measurement), so here it decodes "
                "as LinearSS does, at the block size it picks per request and round, down to plain decoding steps. "
                if share == 0 else f"Its branches rode in up to {share:.0%} of rounds. ")
    return (f"**Measured on the bundled model** (latest `recguide bench`, {env['hardware']}, {env['threads']} threads, "
            f"commit {env['git_commit']}; aggregate tokens/s, C = requests in flight): " + " ".join(parts) + ". "
            + peer + branches
            + f"Every method's greedy output equalled plain HF greedy: {'yes' if lossless else 'NO'}. "
            "Other hardware has other costs (`recguide profile` measures them); Results has every method and the "
            "commands.")


def _span(values) -> str:
    low, high = f"{min(values):.0f}", f"{max(values):.0f}"
    return low if low == high else f"{low}-{high}"


def compile_note(bench: dict) -> str:
    """When compiling pays, from the latest bench: `recguide:compile=true` against eager `recguide` per C
    (`bench.compile_rows`), its warm-up (cold or warm compile cache, as the bench recorded it) and the tokens after
    which it is repaid."""
    from recguide_hf.tools.bench import compile_rows

    rows = compile_rows(bench)
    if not rows:
        return ("**Compiling.** Not in the latest bench: `recguide bench --methods recguide recguide:compile=true` "
                "measures it.")
    env = bench["environment"]
    cache = env.get("compile_cache")
    state = ("an empty compile cache, a cold start" if cache and cache["empty"] else
             "kernels of earlier processes in the compile cache" if cache else "a compile cache of unrecorded state")
    first, later = rows[0], [r["warmup_s"] for r in rows[1:] if r["warmup_s"] is not None]
    faster = [r for r in rows if r["ratio"] > 1]
    text = (f"**Compiling** (`recguide_compile=true`; latest `recguide bench`, {env['hardware']}, {env['threads']} "
            f"threads, commit {env['git_commit']}). Compiled / eager aggregate tokens/s: "
            + ", ".join(f"x{r['ratio']:.2f} at C={r['concurrency']}" for r in rows) + ". "
            f"Warm-up (the untimed first pass that compiles, left out of those ratios): {first['warmup_s']:.0f} s at "
            f"C={first['concurrency']}, from {state}"
            + (f"; {_span(later)} s at each later C, which reuses most graphs" if later else "")
            + ". ")
    if not faster:
        return text + "It was not faster at any C: the default stays eager."
    return text + ("Where it was faster the warm-up is repaid after "
                   + ", ".join(f"{r['repaid_tokens']:,.0f} tokens at C={r['concurrency']}" for r in faster)
                   + " at those rates: compiling pays only in a long-running process (a server, a long evaluation) "
                     "that decodes more than that at those loads, never for one short call, so the default stays "
                     "eager.")


def round_table(res: Path) -> str:
    """Where a round's time goes, before the lean-round work, at the previous landed profile, and now
    (eval/round_profile.py; round_profile_previous.json is the last "now", copied before a rerun)."""
    files = [("before", res / "round_profile_before.json"), ("previous", res / "round_profile_previous.json"),
             ("now", res / "round_profile.json")]
    rows = ["| engine | C | B | ms per round | in forwards | outside forwards | plain step vs HF step |",
            "|---|---|---|---|---|---|---|"]
    cmds, hf = [], {}
    for label, path in files:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if data["results"][0].get("hf_ms_per_step"):
            hf[label] = data["results"][0]["hf_ms_per_step"]
        env = data["environment"]
        cmds.append(f"{label}: `{data['command']}` (commit {env['git_commit']}, {env['hardware']}, "
                    f"{env['threads']} threads)")
        for row in data["results"]:
            for b, v in row["blocks"].items():
                step = f"x{v['step_vs_hf']:.2f}" if v.get("step_vs_hf") else "-"
                rows.append(f"| {label} | {row['C']} | {b} | {v['ms_per_round']:.1f} | {v['forward_ms_per_round']:.1f} "
                            f"| {v['outside_share']:.0%} | {step} |")
    if not cmds:
        return "(run `python eval/round_profile.py --out eval/results/round_profile.json`)"
    speed = ""
    if len(hf) > 1:  # the same HF step, timed in each run: how far the host's own speed moved between them
        speed = (" The host's speed differs between runs: HF's own decoding step at C = 1 took "
                 + ", ".join(f"{ms:.1f} ms ({label})" for label, ms in hf.items())
                 + " on the same 2-core VM, so compare the shares and ratios within a run, not milliseconds "
                   "across runs.")
    return "\n".join(rows) + "\n\nMeasured with " + "; ".join(cmds) + " on an idle CPU." + speed


def compiled_round_table(res: Path) -> str:
    """Where a compiled round's time goes, against HF's compiled decoding step on the same batch
    (eval/round_profile.py --compile), and what a round would have to cost for a given speed-up."""
    path = res / "round_profile_compiled.json"
    if not path.exists():
        return ("(run `python eval/round_profile.py --compile --concurrency 1 --blocks 1 8 16 "
                "--out eval/results/round_profile_compiled.json`)")
    data = json.loads(path.read_text())
    env = data["environment"]
    rows = ["| C | B | ms per round | in forwards | outside forwards | tokens per round | round in HF steps "
            "| decode speed vs HF compiled |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in data["results"]:
        hf = row["hf_ms_per_step"]
        for b, v in row["blocks"].items():
            steps = v["ms_per_round"] / hf
            rows.append(f"| {row['C']} | {b} | {v['ms_per_round']:.1f} | {v['forward_ms_per_round']:.1f} "
                        f"| {v['outside_share']:.0%} | {v['tokens_per_round']:.2f} | {steps:.2f} "
                        f"| x{v['speedup_vs_hf']:.2f} |")
            if int(b) > 1:
                notes.append(f"C = {row['C']}, B = {b}: a round costs {steps:.2f} HF steps and yields "
                             f"{v['tokens_per_round']:.2f} tokens; x1.3 would need {v['tokens_per_round'] / 1.3:.2f} "
                             f"steps per round at that yield, or {1.3 * steps:.2f} tokens per round at that cost")
        warm = row.get("warmup_s", {})
        if warm:
            notes.append(f"warm-up at C = {row['C']}: HF {warm.get('hf', 0):.0f} s, recguide "
                         + ", ".join(f"B = {b} {s:.0f} s" for b, s in warm.items() if b != "hf"))
    return ("\n".join(rows) + f"\n\nMeasured with `{data['command']}` (commit {env['git_commit']}, {env['hardware']}, "
            f"{env['threads']} threads) on an idle CPU, prefills taken off both sides, HF's compiled step "
            + ", ".join(f"{r['hf_ms_per_step']:.2f} ms at C = {r['C']}" for r in data["results"])
            + ". " + "; ".join(notes) + ".")


def serve_table(res: Path) -> str:
    """Where closed-loop serving time goes, before the grouped prefill and now (eval/serve_profile.py;
    serve_profile_before.json is the run at the commit before it)."""
    files = [("before", res / "serve_profile_before.json"), ("now", res / "serve_profile.json")]
    rows = ["| engine | C | method | tok/s | admissions (prefill) | round forwards | policy | other |",
            "|---|---|---|---|---|---|---|---|"]
    cmds = []
    for label, path in files:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        env = data["environment"]
        cmds.append(f"{label}: commit {env['git_commit']}")
        for row in data["results"]:
            for method, v in row["methods"].items():
                rows.append(f"| {label} | {row['C']} | {method} | {v['tokens_per_s']:.0f} | {v['admission_share']:.0%} "
                            f"| {v['round_forward_share']:.0%} | {v['policy_share']:.1%} | {v['other_share']:.0%} |")
    if not cmds:
        return "(run `python eval/serve_profile.py --out eval/results/serve_profile.json`)"
    return ("\n".join(rows) + f"\n\nMeasured with `{data['command']}` ({env['hardware']}, {env['threads']} threads; "
            + "; ".join(cmds) + ") on an idle CPU, one run after the other: compare shares and ratios within a run.")


def branch_table(res: Path) -> str:
    """Whether branches pay on this machine: eval/branch_check.py's measured coverage against its break-even."""
    path = res / "branch_check.json"
    if not path.exists():
        return "(run `python eval/branch_check.py --out eval/results/branch_check.json`)"
    from branch_check import break_even_without_routing, markdown

    data = json.loads(path.read_text())
    env, rows = data["environment"], data["results"]
    free = [r for r in rows if r["coverage"] > break_even_without_routing(r)]

    def paying(results):
        return [r for r in results if r["coverage"] > r["break_even_coverage"]]

    def cases(group):
        return ", ".join(f"C = {r['concurrency']}, B = {r['block']}" for r in group) or "none"

    pays = paying(rows)
    text = (markdown(data) + f"\n\nMeasured with `{env['command']}` ({env['hardware']}, {env['threads']} threads, "
            f"commit {env['git_commit']}) on an idle machine. Coverage was {min(r['coverage'] for r in rows):.0%} to "
            f"{max(r['coverage'] for r in rows):.0%} (the paper reports about 75% of rounds hit on NLD-8B); where it "
            f"beats the break-even: {cases(pays)}; where it would if the adapter's per-token routing cost nothing: "
            f"{cases(free)}." + (" So here the cost rule is right to keep branches off." if not pays else ""))
    compiled = res / "branch_check_compiled.json"
    if compiled.exists():  # the same check through recguide_compile's compiled forward (routing inside the graph)
        data = json.loads(compiled.read_text())
        env = data["environment"]
        text += (f"\n\nThe same with the forwards compiled (`{env['command']}`, commit {env['git_commit']}, the "
                 "warm-up untimed; the routing is part of the compiled graph):\n\n" + markdown(data)
                 + f"\n\nWhere coverage beats the break-even compiled: {cases(paying(data['results']))}.")
    return text


def threads_note(res: Path) -> str:
    """The thread-count advice, from eval/contention.py's measurement."""
    path = res / "contention.json"
    if not path.exists():
        return "(run `python eval/contention.py --out eval/results/contention.json`)"
    data = json.loads(path.read_text())
    by = {(r["threads"], r["mode"]): r for r in data["rows"]}
    parts = []
    for threads in sorted({t for t, _ in by}, reverse=True):
        ar, rg = by[(threads, "ar")], by[(threads, "recguide")]
        parts.append(f"with {threads} torch thread{'s' if threads > 1 else ''}, `ar` x{ar['slowdown']:.2f} and "
                     f"`recguide` x{rg['slowdown']:.2f} (busy / idle; idle `recguide` took "
                     f"x{rg['idle_s'] / ar['idle_s']:.2f} the time of `ar`)")
    env = data["environment"]
    one = by.get((1, "recguide"))
    many = max((r for r in data["rows"] if r["mode"] == "recguide"), key=lambda r: r["threads"])
    advice = ("so on a shared machine set `OMP_NUM_THREADS=1` (or `torch.set_num_threads(1)`) for decoding."
              if one and one["busy_s"] < many["busy_s"] else
              "so on this machine extra threads still paid under contention.")
    return (f"A process busy on the same cores makes every parallel region wait for a descheduled thread. Measured "
            f"with `{env['command']}` ({env['hardware']}, commit {env['git_commit']}), a 1-thread matrix-product loop "
            "running beside it: " + "; ".join(parts) + ", " + advice)


def peers_table() -> list[str]:
    """What each speculative method costs beyond the verifier: parameters and memory, from the bundled folders."""
    main = json.loads((BUNDLED / "config.json").read_text())
    lora = BUNDLED / "draft_lora" / "adapter_model.safetensors"
    assistant = CARDS / "recguide-tiny-assistant"
    kv_per_token = lambda cfg: 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # noqa: E731
    lines = ["| method | what drafts | extra parameters | extra memory |", "|---|---|---|---|",
             "| ar | nothing (HF `generate`) | 0 | 0 |",
             "| hf-lookup | n-grams of the prompt (HF prompt lookup) | 0 | 0 |"]
    if (assistant / "config.json").exists():
        cfg = json.loads((assistant / "config.json").read_text())
        log = json.loads((assistant / "distill_log.json").read_text())
        size = (assistant / "model.safetensors").stat().st_size
        lines.append(f"| hf-assisted | a separate {cfg['num_hidden_layers']}-layer AR draft model "
                     f"(HF `assistant_model`) | {log['trainable_parameters'] / 1e6:.1f}M ({size / 1e6:.0f} MB) | "
                     f"its weights + its own KV cache ({kv_per_token(cfg) / 1e3:.0f} kB per token) |")
    if lora.exists():
        log = json.loads((lora.parent / "distill_log.json").read_text())
        lines.append(f"| linear-N, recguide | the verifier itself in block-diffusion mode, plus a drafting LoRA "
                     f"| {log['trainable_parameters'] / 1e6:.1f}M ({lora.stat().st_size / 1e6:.1f} MB) | the LoRA; "
                     f"draft and branch tokens use scratch slots of the verifier's cache (no second cache; the "
                     f"verifier's is {kv_per_token(main) / 1e3:.0f} kB per token) |")
    return lines


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


def virtual_section(path: Path) -> list[str]:
    """`recguide bench --virtual-costs`: RecGuide against plain AR and the best fixed LinearSS under a GPU cost
    table, labelled as the simulation it is."""
    from recguide_hf.tools.bench import parse_method

    bench = json.loads(path.read_text())
    virtual = bench["settings"]["virtual_costs"]
    by = {(r["method"], r["concurrency"]): r for r in bench["rows"]}
    cs = sorted(c for m, c in by if m == "recguide")
    lines = ["| C | ar tok/s | best fixed LinearSS | its tok/s | recguide tok/s | recguide / best fixed | "
             "recguide / ar | recguide block mix | branch coverage | = AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for c in cs:
        rg = by[("recguide", c)]
        fixed = max((r for (m, cc), r in by.items() if cc == c and parse_method(m)[0] == "linear"),
                    key=lambda r: r["aggregate_tps"])
        ar = by.get(("ar", c))
        ratios[c] = rg["aggregate_tps"] / fixed["aggregate_tps"]
        same = all(r["equal_to_ar"] for (m, cc), r in by.items() if cc == c)
        mix = ", ".join(f"B={b}: {v:.0%}" for b, v in rg["block_mix"].items() if v >= 0.005)
        lines.append(f"| {c} | {ar['aggregate_tps']:.0f} | {fixed['method']} | {fixed['aggregate_tps']:.0f} | "
                     f"{rg['aggregate_tps']:.0f} | x{ratios[c]:.2f} | "
                     + (f"x{rg['aggregate_tps'] / ar['aggregate_tps']:.2f}" if ar else "-")
                     + f" | {mix} | {rg['coverage']:.0%} | {'yes' if same else 'NO'} |")
    rest = [c for c in cs if c > 1]
    mean = sum(ratios[c] for c in rest) / len(rest) if rest else None
    env = bench["environment"]
    summary = (f"RecGuide against the best fixed-block LinearSS: x{ratios[1]:.2f} at C = 1" if 1 in ratios else "")
    if mean is not None:
        summary += f", mean x{mean:.2f} over C = {rest[0]}..{rest[-1]}"
    return ["### Under a GPU cost table (a simulation)", "",
            f"**This is a simulation, not a GPU measurement.** `{env['command']}` (commit {env['git_commit']}) runs "
            "the real engine on the bundled model here, with its real decisions (acceptance, branches, block sizes "
            f"per request and round), but charges every forward the time a cost model gives for its token count: "
            f"{virtual['name']} (`{virtual['file']}`: the published round times and how the missing cells were "
            "filled), and recguide plans with those prices. Nothing but the forwards costs time. Acceptance is the "
            "12M bundled model's, not NLD-8B's. Outputs are deterministic (greedy), so one repeat is exact.", "",
            *lines, "", summary + ".", "", "![simulated frontier](eval/results/virtual_b200/frontier.png)", ""]


def main():
    readme = ROOT / "README.md"
    text = readme.read_text()
    res = ROOT / "eval" / "results"
    lines = [START, "## Results", ""]
    if (res / "bench.md").exists():
        bench = json.loads((res / "bench.json").read_text())
        lines += ["The concurrency frontier of the bundled model on this project's 2-core CPU: every method in one "
                  "run, closed loop, greedy (per-request vs aggregate tokens/s, points labelled by concurrency C). "
                  "Regenerate with `recguide bench --out eval/results` (without `--out` it writes a fresh "
                  "runs/bench-<time>/ folder and leaves these files alone; add `--quick` for a short smoke run: C "
                  "= 1 and 4, 32 new tokens, one repeat). These timings come from a shared 2-core machine: compare "
                  "ratios within one table, not across runs.", "",
                  "![frontier](eval/results/frontier.png)", "", settings_line(bench), "", fastest(bench), "",
                  (res / "bench.md").read_text().strip(), "",
                  "![TPF and tau](eval/results/tpf_tau.png)", "",
                  "The peers in that table, and what each costs beyond the verifier (12M parameters):", "",
                  *peers_table(), ""]
    virtual = res / "virtual_b200" / "bench.json"
    if virtual.exists():
        lines += virtual_section(virtual)
    rho = res / "rho" / "bench.json"
    if rho.exists():
        from recguide_hf.tools.bench import markdown_table

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
        from lm_eval_parity import table

        report = json.loads(parity.read_text())
        mode = next(m for m in report["gen_kwargs"] if m != "ar")
        parity_lines = [f"lm-evaluation-harness, the same tasks as `ar` and as `{mode}` (`python eval/"
                        f"{report['command']}`, backend `{report['backend']}`, commit "
                        f"{report['environment']['git_commit']}):", "", table(report, mode), ""]
        lines += parity_lines
        docs = ROOT / "docs" / "lm_eval.md"
        docs.write_text(replace_between(docs.read_text(), PARITY, "\n".join(parity_lines).strip()))
    card = BUNDLED / "eval_results.json"
    if card.exists():
        r = json.loads(card.read_text())
        he = r["linear_ss"]
        losses = ", ".join(f"held-out {c} AR loss {v['ar_loss']:.2f}" for c, v in r["heldout"].items())
        taus = ", ".join(f"B={k.split('_B')[1]}: {v['tau']:.2f}" for k, v in he.items() if k.startswith("humaneval"))
        card_link = "[model card](recguide_hf/bundled/recguide-tiny/README.md)"
        lines += [f"The bundled model (details in its {card_link}): {losses}; "
                  f"LinearSS tau on HumanEval prompts {taus} (distinct-4-gram ratio "
                  f"{he['humaneval_B16']['distinct4']:.2f}).", ""]
    lines.append(END)
    block = "\n".join(lines)
    head, rest = text.split(START, 1)
    text = head + block + rest.split(END, 1)[1]
    if (res / "bench.json").exists():
        bench = json.loads((res / "bench.json").read_text())
        text = replace_between(text, SPEED, speed_sentence(bench))
        text = replace_between(text, COMPILE, compile_note(bench), sep="")
    text = replace_between(text, ROUND, round_table(res))
    text = replace_between(text, COMPILED_ROUND, compiled_round_table(res))
    text = replace_between(text, SERVE, serve_table(res))
    text = replace_between(text, BRANCHES, branch_table(res))
    text = replace_between(text, ("<!-- threads:start -->", "<!-- threads:end -->"), threads_note(res), sep="")
    text = replace_between(text, SERVING, serving_results(res))
    text = replace_between(text, POLICY, policy_table(res))
    readme.write_text(text)
    print("README results section updated")


if __name__ == "__main__":
    main()
