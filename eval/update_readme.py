"""Refresh the measured blocks of README.md and the documentation pages from the files the runs wrote (nothing
typed by hand).

    python eval/update_readme.py

Each block stands between its `<!-- name:start -->` / `<!-- name:end -->` markers, on whichever page holds them
(README.md, docs/*.md): README has the headline (speed sentence, one table, one plot); the rest lives in the docs
pages (Results, Serving, How it works, Using generate, lm-eval).

The prose of every block is a Markdown template in eval/readme/ (Jinja2); this script reads the results files and
fills them.

Reads eval/results/bench.json / bench.md (+ its PNGs), eval/results/virtual_b200/bench.json (the simulation under
a GPU cost table), eval/results/round_profile*.json, serve_profile*.json,
engine.json, recguide_hf/bundled/recguide-tiny/eval_results.json and eval/results/lm_eval_parity.json when present, and
rewrites the text between the results markers, the speed sentence of the introduction (between the speed
markers), the compile note of the performance notes (between the compile markers), the round-time, serving-time
and branch tables of "How it works" (between the round, serve and branches markers), and the lm-eval parity table
of docs/lm_eval.md (between its parity markers).
"""

from __future__ import annotations

import functools
import json
import re
import statistics
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
RAY = ("<!-- ray:start -->", "<!-- ray:end -->")
VLLM = ("<!-- vllm:start -->", "<!-- vllm:end -->")
VLLM_HEADLINE = ("<!-- vllm-headline:start -->", "<!-- vllm-headline:end -->")
POLICY = ("<!-- policy:start -->", "<!-- policy:end -->")
SMOLLM2 = ("<!-- smollm2:start -->", "<!-- smollm2:end -->")
SMOLLM2_HEADLINE = ("<!-- smollm2-headline:start -->", "<!-- smollm2-headline:end -->")
SMOLLM2_RUN = ("<!-- smollm2-run:start -->", "<!-- smollm2-run:end -->")
TEMPLATES = Path(__file__).resolve().parent / "readme"  # the prose of every block, in Markdown (Jinja2)


class Raw(str):
    """A block already in Markdown (a table another module writes): placed as it is, never re-wrapped."""


@functools.cache
def _templates():
    """The one Jinja2 environment over eval/readme/ (every render reads its templates through it)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["fmt"] = format
    env.globals.update(yes=lambda ok: "yes" if ok else "NO")
    return env


def render(name: str, **context) -> str:
    """`eval/readme/<name>` filled with `context`. Templates wrap their prose at 120 columns for reading; a line
    that continues a paragraph (not a table row, image, heading, list item, or a blank line) is joined to the
    line before it with one space, so the README keeps one line per paragraph as before."""
    raws = {}
    for key, value in list(context.items()):
        if isinstance(value, Raw):
            raws[key] = value
            context[key] = f"\x00{key}\x00"
    text = _templates().get_template(name).render(**context)
    out: list[str] = []
    for line in text.split("\n"):
        prev = out[-1] if out else ""
        joins = (prev and line and not prev.startswith(("|", "\x00", "!", "#"))
                 and not line.startswith(("|", "\x00", "!", "#", "* ", "```")))
        if joins:
            out[-1] = prev + " " + line.strip()
        else:
            out.append(line)
    text = "\n".join(out)
    for key, value in raws.items():
        text = text.replace(f"\x00{key}\x00", value)
    return portable(text).strip("\n")


def portable(text: str) -> str:
    """A run's command as typed on the machine that ran it, as the pages show it: paths inside this repository
    relative to it, a known model's folder (wherever that machine's cache was) as `$(recguide fetch NAME)`."""
    from recguide_hf.models.known import KNOWN_MODELS

    text = text.replace(f"{ROOT}/", "")  # this checkout; and any other checkout's (the run's machine may differ)
    text = re.sub(r"(?<![\w.~])/[\w./-]*?/(eval|recguide_hf|docs|training|tests)/", r"\1/", text)
    for name in KNOWN_MODELS:
        text = re.sub(rf"(?<![\w.~])/[\w./-]*/{name}(?![\w-])", f"$(recguide fetch {name})", text)
    return text


def policy_table(res: Path) -> str:
    """eval/policy_check.py's run (policy_check.json): the default policy against every fixed choice on held-out
    prompts, static batches, with and without the online value correction."""
    path = res / "policy_check.json"
    if not path.exists():
        return render("policy.md", run=None)
    run = json.loads(path.read_text())
    rows = run["results"]
    for row in rows:
        row["same"] = all(v for m, v in row["equal_hf_greedy"].items() if m != "hf-ar")
    context = {"run": run, "env": run["environment"], "rows": rows, "methods": list(rows[0]["tok_s"]),
               "paired": all("paired_ratios" in row for row in rows),
               "priced": all("table_priced" in row for row in rows), "virtual": None, "closed": None}
    virtual = res / "virtual_b200_policy" / "bench.json"
    if virtual.exists():
        v = json.loads(virtual.read_text())
        context.update(virtual=v, virtual_parts=against_best_other(v["rows"]),
                       virtual_same=all(r["equal_to_ar"] for r in v["rows"]))
    closed = res / "policy_closed_loop" / "bench.json"
    context["closed"] = json.loads(closed.read_text()) if closed.exists() else None
    if context["closed"]:
        context["closed_rows"] = against_best_other(context["closed"]["rows"])
        context["closed_methods"] = list(context["closed_rows"][0]["rows"])
        context["closed_priced"] = any(r["priced"] is not None for r in context["closed_rows"])
    return render("policy.md", **context)


def against_best_other(rows: list[dict], ours: str = "recguide", settings: bool = False) -> list[dict]:
    """Per C of a bench run, ascending: its rows by method and `ours` against the fastest other method
    (`bench.against_fastest_other`, methods by name; `paired`: the median of the per-repeat ratios, None without
    them), and whether every method's output equalled HF greedy there. `settings`: the fastest of `ours`'s own
    settings (compiled or not) against the fastest method of another base."""
    from recguide_hf.tools.bench import against_fastest_other

    by_c: dict[int, list[dict]] = {}
    for r in rows:
        by_c.setdefault(r["concurrency"], []).append(r)
    out = []
    for c, rows_c in sorted(by_c.items()):
        a = against_fastest_other(rows_c, ours, settings=settings)
        out.append({"c": c, "ours": a["ours"]["method"], "rows": {r["method"]: r for r in rows_c},
                    "best": a["best"]["method"], "ratio": a["ratio"],
                    "paired": statistics.median(a["paired"]) if a["paired"] else None,
                    "best_top": a["best_top"]["method"], "ratio_top": a["ratio_top"],
                    "best_priced": a["best_priced"]["method"] if a["best_priced"] is not None else None,
                    "priced": a["priced"], "same": all(r["equal_to_ar"] for r in rows_c)})
    return out


def serving_results(res: Path) -> str:
    """The open-loop runs (`recguide bench --arrivals`, results in open_loop_*/) and the server's load test
    (eval/serve_load.py, serve_load.json), each with its command, as measured."""
    from recguide_hf.tools.openloop import describe, markdown_open, verdict

    runs = []
    for folder in sorted(res.glob("open_loop_*")):
        path = folder / "open_loop.json"
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        pngs = [(png, png[10:-4]) for png in ("open_loop_in_flight.png", "open_loop_latency_cdf.png")
                if (folder / png).exists()]
        runs.append({"trace_text": describe(run["trace"]), "virtual": run["settings"].get("virtual_costs"),
                     "env": run["environment"], "requests": len(run["trace"]["arrivals"]), "settings": run["settings"],
                     "table": markdown_open(run["rows"]), "verdict": verdict(run["rows"]), "pngs": pngs,
                     "folder": folder.name, "path": folder.relative_to(ROOT)})
    load = res / "serve_load.json"
    text = render("serving.md", open_runs=runs, ceiling=ceiling_summary(res / "open_loop_ceiling" / "ceiling.json"),
                  load=json.loads(load.read_text()) if load.exists() else None)
    return text or "(no serving runs recorded yet)"


def ray_results(res: Path) -> str:
    """`recguide serve --replicas` on Ray Serve (eval/ray_session.sh, results in ray/): the load test with its
    leave and overload checks, the same trace on 1 x 2 threads and on plain `recguide serve`, a replica killed
    mid-load, autoscaling, and lm-eval's local-completions through both servers."""
    d = res / "ray"
    names = ("load", "load_1x2", "load_single", "kill", "autoscale", "lm_eval_endpoint")
    runs = {name: json.loads((d / f"{name}.json").read_text()) for name in names if (d / f"{name}.json").exists()}
    if not runs:
        return "(not measured yet: bash eval/ray_session.sh)"
    throughput = [(label, runs[name]) for name, label in (("load", "2 Ray replicas x 1 thread"),
                                                          ("load_1x2", "1 Ray replica x 2 threads"),
                                                          ("load_single", "`recguide serve` (one process, 2 threads)"))
                  if name in runs]
    return render("ray.md", load=runs.get("load"), throughput=throughput, kill=runs.get("kill"),
                  autoscale=runs.get("autoscale"), lm_eval=runs.get("lm_eval_endpoint"))


def vllm_results(res: Path) -> str:
    """`recguide serve` against vLLM, and vLLM with RecGuide's proposer (eval/vllm_peer.py, results in vllm/): one
    table per run, each server's output tok/s against plain vLLM's in the same pass."""
    runs = []
    for path in sorted((res / "vllm").glob("*.json"), key=lambda p: (json.loads(p.read_text())["clients"], p.name)):
        run = json.loads(path.read_text())
        plain = {r["pass"]: r["tokens_per_s"] for r in run["rows"] if r["server"] == "vllm"}
        for r in run["rows"]:
            r["ratio"] = f"x{r['tokens_per_s'] / plain[r['pass']]:.2f}" if r["pass"] in plain else "-"
            spec = r.get("spec") or {}
            r["tau"] = f"{spec['tau']:.2f}" if spec.get("tau") else "-"
            r.setdefault("equal_to_vllm_greedy", None)
        runs.append(run)
    if not runs:
        return "(not measured yet: python eval/vllm_peer.py)"
    return render("vllm.md", runs=runs)


def vllm_headline(res: Path) -> str:
    """README's line on vLLM: `recguide serve` against vLLM at one load (peer_c4.json), and vLLM with RecGuide's
    proposer against plain vLLM at each load (plugin_c*.json): medians over passes of output tok/s."""
    def medians(run):
        by = {}
        for r in run["rows"]:
            by.setdefault(r["server"], []).append(r)
        return {k: {"tok_s": statistics.median(r["tokens_per_s"] for r in v),
                    "startup_s": statistics.median(r["startup_s"] for r in v),
                    "rss_mb": statistics.median(r["rss_mb"] for r in v),
                    "tau": statistics.median(r["spec"]["tau"] for r in v) if all(
                        (r.get("spec") or {}).get("tau") for r in v) else None,
                    "drafts": statistics.median((r.get("spec") or {}).get("num_drafts") or 0 for r in v),
                    "equal": all(r["equal_to_hf_greedy"] == r["finished"] for r in v)} for k, v in by.items()}

    d = res / "vllm"
    peer = d / "peer_c4.json"
    if not peer.exists():
        return "(vLLM not measured yet: python eval/vllm_peer.py)"
    run = json.loads(peer.read_text())
    plugin = []
    for path in sorted(d.glob("plugin_c*.json"), key=lambda p: json.loads(p.read_text())["clients"]):
        r = json.loads(path.read_text())
        plugin.append({"clients": r["clients"], "m": medians(r), "block": r["plugin_block"],
                       "vllm_equal": all(row.get("equal_to_vllm_greedy") and
                                         row["equal_to_vllm_greedy"].split("/")[0] == row["equal_to_vllm_greedy"]
                                         .split("/")[1] for row in r["rows"])})
    return render("vllm_headline.md", run=run, m=medians(run), plugin=plugin)


def smollm2_results(res: Path) -> str:
    """SmolLM2-135M-Instruct's measurements (eval/smollm2_session.sh, results in smollm2/): the tau curve, the shipped
    adapter and the issue's prompt, the CPU bench against HF's fast paths, the B200 simulation (closed and open
    loop) and lm-eval's local tasks, each with the command that made it; in previous/ (with its README.md saying
    which adapter), what was measured on the adapter shipped before and not re-measured on this one."""
    d = res / "smollm2"
    if not (d / "check.json").exists():
        return "(SmolLM2 not measured yet: bash eval/smollm2_session.sh WORK)"
    out = [engine_tau_section(d), ab_section(d)]
    check = json.loads((d / "check.json").read_text())
    rg = check["generate"]["recguide"]
    out += ["### As shipped", "", f"`{rg['command']}` printed (equal to the base's HF greedy output: "
            f"{'yes' if all(r['equal_to_hf_greedy'] for r in check['generate'].values()) else 'NO'}):", "",
            indented(rg["printed"]), ""]
    out += measured_sections(d)
    if (d / "previous").is_dir():  # measured on the adapter shipped before this one, not re-measured yet
        out += ["### Not re-measured yet: the adapter shipped before", "",
                (d / "previous" / "README.md").read_text().strip(), "", *measured_sections(d / "previous", 4)]
    return portable("\n".join(out).rstrip())


def measured_sections(d: Path, level: int = 3) -> list[str]:
    """The speed and parity sections of one SmolLM2 results folder (cpu/, b200/, b200_open/, lm_eval_*.json): the
    CPU bench against HF's fast paths, the B200 simulation (closed and open loop) and lm-eval's local tasks."""
    from lm_eval_parity import table as parity_table

    from recguide_hf.tools.openloop import markdown_open, verdict

    out: list[str] = []
    for name, title in (("cpu", "CPU closed loop against HF's fast paths"),
                        ("b200", "Closed loop under the B200 cost table (a simulation: this model's acceptance, "
                                 "NLD-8B's prices)")):
        if (d / name / "bench.md").exists():
            out += [f"{'#' * level} {title}", "", (d / name / "bench.md").read_text().strip(), ""]
            if name == "cpu":
                from recguide_hf.tools.bench import fastest_other_table

                table, _ = fastest_other_table(json.loads((d / name / "bench.json").read_text()))
                out += ["RecGuide against the fastest other method of the run at each C:", "", table, ""]
    if (d / "b200_open" / "open_loop.json").exists():
        run = json.loads((d / "b200_open" / "open_loop.json").read_text())
        out += [f"{'#' * level} Bursty open loop under the B200 cost table (a simulation)", "",
                f"Command: `{run['environment']['command']}`", "", markdown_open(run["rows"]), "",
                verdict(run["rows"]) or "", ""]
    if (d / "lm_eval_parity.json").exists():
        report = json.loads((d / "lm_eval_parity.json").read_text())
        mode = next(m for m in report["gen_kwargs"] if m != "ar")
        out += [f"{'#' * level} lm-eval's local tasks", "", f"Command: `python eval/{report['command']}`", "",
                parity_table(report, mode), ""]
        if (d / "lm_eval_bundled.json").exists():
            bundled = json.loads((d / "lm_eval_bundled.json").read_text())
            out += ["| task | SmolLM2 exact match / edit similarity | bundled recguide-tiny |", "|---|---|---|"]
            for task, t in report["tasks"].items():
                b = bundled["tasks"][task]["metrics"]["ar"]
                m = t["metrics"]["ar"]
                out.append(f"| {task} | {m['exact_match']:.3f} / {m['edit_similarity']:.3f} | "
                           f"{b['exact_match']:.3f} / {b['edit_similarity']:.3f} |")
            out.append("")
    return out


def engine_tau_section(d: Path) -> str:
    """Acceptance as decoding sees it (eval/engine_tau.py: engine_tau_before.json, the adapter shipped before, and
    engine_tau.json, the one shipped now): per held-out set and output length, LinearSS tau at B = 4 / 8 / 16, TPF at
    B = 8, the acceptance profile, RecGuide auto, the estimates at B = 8 and the parity check."""
    runs = [(label, json.loads((d / name).read_text())) for label, name in
            (("before", "engine_tau_before.json"), ("now", "engine_tau.json")) if (d / name).exists()]
    if not runs:
        return "### Acceptance as decoding sees it\n\n(not measured yet: python eval/engine_tau.py)\n"
    out = ["### Acceptance as decoding sees it", "",
           "LinearSS greedy decoding through the engine on held-out prompts (chat: held-out instructions through the "
           "chat template; code: held-out raw code), tau = new tokens / rounds; `= greedy`: every output equalled the "
           "base's HF greedy continuation. RecGuide auto decides by the shipped CPU cost table, where drafting rarely "
           "pays, so its tau says little about the drafter. The estimates (B = 8, same prompts, teacher-forced on the "
           "reference): the one `recguide distill` used to log (anchors every 4 tokens), the same mean over every "
           "anchor, and decoding's own path over those runs (a round at t, the next at t + n + 1).", ""]
    for label, run in runs:
        out += [f"**{label}** (adapter: {run['adapter']}, first draft from {run['first_draft']}; "
                f"`{run['command']}`):", "",
                "| set | new tokens | prompts | tau B=4 | tau B=8 | tau B=16 | TPF B=8 | accepted k = 1..4 (B=8) | "
                "RecGuide auto tau (block mix) | estimate logged / every anchor / decoding path | = greedy |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, r in run["sets"].items():
            name, length = key.rsplit("_", 1)
            auto, est = r["recguide_auto"], r["estimate_B8"]
            mix = ", ".join(f"{b}: {n}" for b, n in sorted(auto["block_mix"].items(), key=lambda kv: int(kv[0])))
            acc = ", ".join(f"{a:.2f}" for a in r["accept_B8"][:4])
            out.append(f"| {name} | {length} | {r['num_prompts']} | {r['tau_B4']:.2f} | {r['tau_B8']:.2f} | "
                       f"{r['tau_B16']:.2f} | {r['tpf_B8']:.2f} | {acc} | {auto['tau']:.2f} ({mix}) | "
                       f"{est['distill_logged']:.2f} / {est['every_anchor']:.2f} / {est['decoding_path']:.2f} | "
                       f"{'yes' if r['equal'] and auto['equal'] else 'NO'} |")
        out.append("")
    return "\n".join(out)


AB_ARMS = ("mask", "verifier", "verifier-confidence")


def ab_section(d: Path) -> str:
    """The equal-budget A/B arms of the drafting recipe (eval/drafter_ab.sh, logs in smollm2/ab/): per arm its
    training CPU core-hours and tau by decoding at its start and end, held-out chat and code and training prompts."""
    arms = [(name, json.loads((d / "ab" / f"{name}.json").read_text())) for name in AB_ARMS
            if (d / "ab" / f"{name}.json").exists()]
    if not arms:
        return ""
    first = arms[0][1]["args"]
    # the same start: arms that draft in one layout measure the same figure before their first step (the mask arm
    # decodes the start in its own layout): one start figure per layout
    layouts = {log["args"].get("first_draft") for _, log in arms}
    same = len({(log["args"].get("first_draft"), log["log"][0]["tau_B8_chat"]) for _, log in arms}) == len(layouts)
    out = ["### Choosing the recipe: equal-budget arms", "",
           f"Each arm continues the same adapter (the one shipped at 4074f90: `INIT=` in the script) for "
           f"{float(first['minutes']):.0f} minutes of training on the same {arms[0][1]['teacher_rows']['rows']} "
           f"teacher rows (lr {first['lr']}; `bash eval/drafter_ab.sh TEACHER`); tau by decoding (LinearSS, held-out "
           "prompts, 128 new tokens) at the arm's start -> end (" + ("arms of one layout start from the same "
           "figures" if same else "WARNING: arms of one layout start from different figures") + "); `train`: as "
           "many training prompts, to show overfitting.", "",
           "| arm | recipe | CPU core-hours | chat B=4 | chat B=8 | chat B=16 | code B=4 | code B=8 | code B=16 | "
           "train B=8 | = greedy |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, log in arms:
        a, start, end = log["args"], log["log"][0], log["log"][-1]
        recipe = f"first draft: {a.get('first_draft', 'mask')}, weights: {a.get('weights', 'decay')}"
        cells = [f"{start[f'tau_B{b}_{s}']:.2f} -> {end[f'tau_B{b}_{s}']:.2f}" for s in ("chat", "code")
                 for b in (4, 8, 16)]
        same = all(end.get(f"equal_{s}") for s in ("chat", "code", "train"))
        out.append(f"| {name} | {recipe} | {log['cpu_seconds'] / 3600:.2f} | " + " | ".join(cells)
                   + f" | {start['tau_B8_train']:.2f} -> {end['tau_B8_train']:.2f} | {'yes' if same else 'NO'} |")
    best = max(arms, key=lambda a: a[1]["log"][-1]["tau_B8_chat"] + a[1]["log"][-1]["tau_B8_code"])
    end = best[1]["log"][-1]
    out += ["", f"Highest tau at B = 8 (chat + code) at the end: **{best[0]}** (chat {end['tau_B8_chat']:.2f}, code "
            f"{end['tau_B8_code']:.2f}).", ""]
    return "\n".join(out)


def indented(printed: str) -> str:
    """A command's output as an indented Markdown block (not fenced: a model's reply holds fences of its own)."""
    return "\n".join("    " + line if line.strip() else "" for line in printed.rstrip().splitlines())


def smollm2_run(res: Path) -> str:
    """What README's first command printed, as eval/smollm2_check.py ran it (and whether it equalled HF greedy)."""
    path = res / "smollm2" / "check.json"
    if not path.exists():
        return "(not run yet)"
    check = json.loads(path.read_text())
    rg = check["generate"]["recguide"]
    same = "equal" if all(r["equal_to_hf_greedy"] for r in check["generate"].values()) else "NOT equal"
    return (f"{indented(rg['printed'])}\n\n(`eval/smollm2_check.py`'s run of that command, {same} to the base "
            "model's HF greedy output token for token; the speed is this 2-core CPU's.)")


def smollm2_headline(res: Path) -> str:
    """README's sentence on the real model: held-out tau, the CPU bench against the fastest other method, the B200
    simulation against the best fixed block, lossless or not; each from its results file."""
    from recguide_hf.tools.bench import against_fastest_other, parse_method

    d = res / "smollm2"
    if not (d / "check.json").exists():
        return "(SmolLM2 not measured yet)"
    check = json.loads((d / "check.json").read_text())
    log = json.loads((ROOT / "recguide_hf" / "bundled" / "smollm2" / "draft_lora" / "distill_log.json").read_text())
    parts = [f"**On SmolLM2-135M-Instruct**, a real instruct model (`recguide fetch smollm2`; its drafting LoRA "
             f"trained here by `recguide distill`, {log['cpu_seconds'] / 3600:.1f} CPU core-hours in its last run"
             + (", which continued an earlier adapter: the card says how)" if log["args"].get("init") else ")")]
    if (d / "engine_tau.json").exists():
        sets = json.loads((d / "engine_tau.json").read_text())["sets"]
        by_set: dict[str, list[str]] = {}
        for key, r in sets.items():
            name, length = key.rsplit("_", 1)
            by_set.setdefault(name, []).append(f"{r['tau_B8']:.2f} ({length} tokens)")
        parts[0] += (": tau at B = 8 as decoding sees it (LinearSS on held-out prompts) "
                     + ", ".join(f"{name} {' / '.join(v)}" for name, v in by_set.items()))
    lossless = all(r["equal_to_hf_greedy"] for r in check["generate"].values())
    if (d / "cpu" / "bench.json").exists():
        bench = json.loads((d / "cpu" / "bench.json").read_text())
        lossless &= all(r["equal_to_ar"] for r in bench["rows"])
        by_c: dict[int, list] = {}
        for r in bench["rows"]:
            by_c.setdefault(r["concurrency"], []).append(r)
        cells = []
        for c in sorted(by_c):
            a = against_fastest_other(by_c[c], "recguide", None, settings=True)
            if a is not None:
                cells.append(f"C = {c} x{a['ratio']:.2f} ({a['best']['method']})")
        parts.append(f"on this CPU ({bench['environment']['hardware']}) RecGuide against the fastest non-RecGuide "
                     "method: "
                     + ", ".join(cells))
    if (d / "b200" / "bench.json").exists():
        bench = json.loads((d / "b200" / "bench.json").read_text())
        lossless &= all(r["equal_to_ar"] for r in bench["rows"])
        cells = []
        for c in sorted({r["concurrency"] for r in bench["rows"]}):
            rows = [r for r in bench["rows"] if r["concurrency"] == c]
            rg = next((r for r in rows if parse_method(r["method"])[0] == "recguide"), None)
            fixed = [r for r in rows if parse_method(r["method"])[0] in ("linear", "ar")]  # ar: B = 1, fixed
            if rg and fixed:
                best = max(fixed, key=lambda r: r["aggregate_tps"])
                cells.append(f"C = {c} x{rg['aggregate_tps'] / best['aggregate_tps']:.2f} ({best['method']})")
        parts.append("under the B200 cost table (a simulation) against the best fixed block (plain AR included): "
                     + ", ".join(cells))
    return "; ".join(parts) + f". Every output equalled the base's HF greedy: {'yes' if lossless else 'NO'}. " \
        "[A real model](docs/distill.md) has acceptance as decoding sees it, the recipe's A/B arms, every table and " \
        "the commands."


def ceiling_summary(path: Path) -> dict | None:
    """eval/open_loop_ceiling.py's run: each load oracle's mean decoding speed and p99 TTFT against the best single
    fixed method of the same run."""
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    oracles = [r for r in run["rows"] if r["method"] in run["oracle_tables"]]
    fixed = [r for r in run["rows"] if r["method"] not in run["oracle_tables"] and r["method"] != "recguide"]
    if not oracles or not fixed:
        return None
    best = max(fixed, key=lambda r: r["decode_speed_mean"])
    what = {"oracle": "the fastest by aggregate tok/s", "oracle-per-request": "the fastest by per-request tok/s"}
    return {"environment": run["environment"], "best": best["method"],
            "oracles": [{"method": r["method"],
                         "what": what.get(r["method"], "thresholds " + ", ".join(
                             f"B = {b} from {c} in flight" for c, b in run["oracle_tables"][r["method"]].items())),
                         "speed": r["decode_speed_mean"] / best["decode_speed_mean"],
                         "ttft": r["ttft_p99"] / best["ttft_p99"]} for r in oracles]}


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
    # the fastest other method at each C: what a user could have picked instead
    # the fastest other method at each C, against RecGuide's fastest setting there (a compiled RecGuide is RecGuide)
    best = {p["c"]: (p["best"], p["ratio"], p["ours"]) for p in against_best_other(bench["rows"], settings=True)
            if p["c"] in cs}
    from recguide_hf.tools.bench import HF_AR, parse_method

    hf = {}  # HF's fastest autoregressive path at each C (plain, static cache, compiled, continuous batching)
    for c in cs:
        rows = [r for (m, cc), r in by.items() if cc == c and parse_method(m)[0] in HF_AR]
        if any(parse_method(r["method"])[0] != "ar" for r in rows):
            fast = max(rows, key=lambda r: r["aggregate_tps"])
            hf[c] = (fast, by[("recguide", c)]["aggregate_tps"] / fast["aggregate_tps"])
    return render("speed.md", env=bench["environment"],
                  span=lambda group: ", ".join(f"C={c} (x{ratio[c]:.2f})" for c in group),
                  faster=[c for c in cs if ratio[c] >= 1.0], slower=[c for c in cs if ratio[c] < 1.0], best=best,
                  best_ratios=[best[c][1] for c in cs],
                  behind=[c for c in cs if round(best[c][1], 2) < 0.97],  # as shown, two decimals
                  hf=dict(sorted(hf.items())),
                  warm=sorted({round(f["warmup_s"]) for f, _ in hf.values() if "warmup_s" in f}),
                  share=max(by[("recguide", c)].get("branch_round_share", 0.0) for c in cs),
                  lossless=all(r["equal_to_ar"] for r in bench["rows"]))


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
        return render("compile.md", rows=rows)
    env = bench["environment"]
    cache = env.get("compile_cache")
    state = ("an empty compile cache, a cold start" if cache and cache["empty"] else
             "kernels of earlier processes in the compile cache" if cache else "a compile cache of unrecorded state")
    later = [r["warmup_s"] for r in rows[1:] if r["warmup_s"] is not None]
    return render("compile.md", rows=rows, env=env, cache_state=state, later=later,
                  later_span=_span(later) if later else "", faster=[r for r in rows if r["ratio"] > 1])


def round_table(res: Path) -> str:
    """Where a round's time goes, before the lean-round work, at the previous landed profile, and now
    (eval/round_profile.py; round_profile_previous.json is the last "now", copied before a rerun)."""
    files = [("before", res / "round_profile_before.json"), ("previous", res / "round_profile_previous.json"),
             ("now", res / "round_profile.json")]
    runs, table, hf = [], [], {}
    for label, path in files:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if data["results"][0].get("hf_ms_per_step"):
            hf[label] = data["results"][0]["hf_ms_per_step"]
        runs.append((label, data))
        table += [(label, row, b, v) for row in data["results"] for b, v in row["blocks"].items()]
    return render("round.md", runs=runs, table=table, hf=hf)


def compiled_round_table(res: Path) -> str:
    """Where a compiled round's time goes, against HF's compiled decoding step on the same batch
    (eval/round_profile.py --compile), and what a round would have to cost for a given speed-up."""
    path = res / "round_profile_compiled.json"
    if not path.exists():
        return render("compiled_round.md", data=None)
    data = json.loads(path.read_text())
    notes = []
    for row in data["results"]:
        for b, v in row["blocks"].items():
            if int(b) > 1:
                steps = v["ms_per_round"] / row["hf_ms_per_step"]
                notes.append({"kind": "round", "C": row["C"], "b": b, "steps": steps, "tokens": v["tokens_per_round"]})
        if row.get("warmup_s"):
            notes.append({"kind": "warm-up", "C": row["C"], "warm": row["warmup_s"]})
    return render("compiled_round.md", data=data, notes=notes)


def serve_table(res: Path) -> str:
    """Where closed-loop serving time goes, before the grouped prefill and now (eval/serve_profile.py;
    serve_profile_before.json is the run at the commit before it)."""
    files = [("before", res / "serve_profile_before.json"), ("now", res / "serve_profile.json")]
    runs = [(label, json.loads(path.read_text())) for label, path in files if path.exists()]
    return render("serve.md", runs=runs, last=runs[-1][1] if runs else None)


def branch_table(res: Path) -> str:
    """Whether branches pay on this machine: eval/branch_check.py's measured coverage against its break-even."""
    path = res / "branch_check.json"
    if not path.exists():
        return render("branches.md", data=None)
    from branch_check import break_even_without_routing, markdown

    def paying(results):
        return [r for r in results if r["coverage"] > r["break_even_coverage"]]

    data = json.loads(path.read_text())
    rows = data["results"]
    context = {"data": data, "table": Raw(markdown(data)), "low": min(r["coverage"] for r in rows),
               "high": max(r["coverage"] for r in rows), "pays": paying(rows),
               "free": [r for r in rows if r["coverage"] > break_even_without_routing(r)], "compiled": None,
               "cases": lambda group: ", ".join(f"C = {r['concurrency']}, B = {r['block']}" for r in group) or "none"}
    compiled = res / "branch_check_compiled.json"
    if compiled.exists():  # the same check through recguide_compile's compiled forward (routing inside the graph)
        data = json.loads(compiled.read_text())
        context.update(compiled=data, compiled_table=Raw(markdown(data)), compiled_pays=paying(data["results"]))
    return render("branches.md", **context)


def threads_note(res: Path) -> str:
    """The thread-count advice, from eval/contention.py's measurement."""
    path = res / "contention.json"
    if not path.exists():
        return render("threads.md", data=None)
    data = json.loads(path.read_text())
    by = {(r["threads"], r["mode"]): r for r in data["rows"]}
    parts = [{"threads": t, "ar": by[(t, "ar")], "rg": by[(t, "recguide")]}
             for t in sorted({t for t, _ in by}, reverse=True)]
    one = by.get((1, "recguide"))
    many = max((r for r in data["rows"] if r["mode"] == "recguide"), key=lambda r: r["threads"])
    return render("threads.md", data=data, parts=parts, one_thread_wins=bool(one and one["busy_s"] < many["busy_s"]))


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


def fastest(bench: dict) -> list:
    """(C, row) of the method with the highest aggregate tokens/s at each C of the bench run."""
    best = {}
    for r in bench["rows"]:
        c = r["concurrency"]
        if c not in best or r["aggregate_tps"] > best[c]["aggregate_tps"]:
            best[c] = r
    return sorted(best.items())


def engine_section(path: Path) -> list[str]:
    e = json.loads(path.read_text())
    return render("engine.md", e=e, c1=e["concurrency_1"], b=e["batched_c8"]).split("\n")


def virtual_section(path: Path) -> list[str]:
    """`recguide bench --virtual-costs`: RecGuide against plain AR and the best fixed LinearSS under a GPU cost
    table, labelled as the simulation it is."""
    from recguide_hf.tools.bench import parse_method

    bench = json.loads(path.read_text())
    by = {(r["method"], r["concurrency"]): r for r in bench["rows"]}
    rows, ratios = [], {}
    for c in sorted(c for m, c in by if m == "recguide"):
        rg = by[("recguide", c)]
        fixed = max((r for (m, cc), r in by.items() if cc == c and parse_method(m)[0] == "linear"),
                    key=lambda r: r["aggregate_tps"])
        ratios[c] = rg["aggregate_tps"] / fixed["aggregate_tps"]
        rows.append({"c": c, "rg": rg, "fixed": fixed, "ar": by.get(("ar", c)), "ratio": ratios[c],
                     "same": all(r["equal_to_ar"] for (m, cc), r in by.items() if cc == c),
                     "mix": ", ".join(f"B={b}: {v:.0%}" for b, v in rg["block_mix"].items() if v >= 0.005)})
    rest = [c for c in ratios if c > 1]
    return render("virtual.md", env=bench["environment"], virtual=bench["settings"]["virtual_costs"], rows=rows,
                  ratios=ratios, rest=rest,
                  mean=sum(ratios[c] for c in rest) / len(rest) if rest else None).split("\n") + [""]


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # where the blocks' markers may stand
HEADLINE = ("<!-- headline:start -->", "<!-- headline:end -->")


def headline(bench: dict) -> str:
    """README's one table and one plot: RecGuide's fastest setting against the fastest non-RecGuide method of the
    latest bench, per C."""
    from recguide_hf.tools.bench import fastest_other_table

    table, _ = fastest_other_table(bench, label="fastest non-RecGuide method", settings=True)
    return render("headline.md", env=bench["environment"], table=Raw(table))


def place(blocks: list[tuple[tuple[str, str], str, str]], pages: list[Path] = PAGES) -> dict[Path, str]:
    """Each block (markers, body, separator) written between its markers on every page that has them; a block whose
    markers stand on no page is an error (a page was renamed or its markers lost). Returns the pages' new texts."""
    texts = {page: page.read_text() for page in pages if page.exists()}
    for markers, body, sep in blocks:
        homes = [page for page, text in texts.items() if markers[0] in text]
        if not homes:
            raise SystemExit(f"no page holds the {markers[0]} marker")
        for page in homes:
            texts[page] = replace_between(texts[page], markers, body, sep)
    return texts


def blocks() -> list[tuple[tuple[str, str], str, str]]:
    """Every measured block: (its markers, its text, the separator around it), from the results files."""
    res = ROOT / "eval" / "results"
    context = {"bench": None, "virtual": None, "rho": None, "engine": None, "parity": None, "card": None}
    if (res / "bench.md").exists():
        bench = json.loads((res / "bench.json").read_text())
        context.update(bench=bench, fastest=fastest(bench), bench_md=Raw((res / "bench.md").read_text().strip()),
                       peers=Raw("\n".join(peers_table())))
    virtual = res / "virtual_b200" / "bench.json"
    if virtual.exists():
        context["virtual"] = Raw("\n".join(virtual_section(virtual)))
    rho = res / "rho" / "bench.json"
    if rho.exists():
        from recguide_hf.tools.bench import markdown_table

        context["rho"] = json.loads(rho.read_text())
        context["rho_table"] = Raw(markdown_table(context["rho"]))
    if (res / "engine.json").exists():
        context["engine"] = Raw("\n".join(engine_section(res / "engine.json")))
    out = []
    parity = res / "lm_eval_parity.json"
    if parity.exists():
        from lm_eval_parity import table

        report = json.loads(parity.read_text())
        mode = next(m for m in report["gen_kwargs"] if m != "ar")
        context["parity"] = Raw(render("parity.md", report=report, mode=mode, table=Raw(table(report, mode))))
        out.append((PARITY, context["parity"], "\n"))
    card = BUNDLED / "eval_results.json"
    if card.exists():
        r = json.loads(card.read_text())
        he = r["linear_ss"]
        context["card"] = {
            "losses": ", ".join(f"held-out {c} AR loss {v['ar_loss']:.2f}" for c, v in r["heldout"].items()),
            "taus": ", ".join(f"B={k.split('_B')[1]}: {v['tau']:.2f}" for k, v in he.items()
                              if k.startswith("humaneval")),
            "distinct4": he["humaneval_B16"]["distinct4"]}
    out.append(((START, END), render("results.md", **context) + "\n", "\n"))
    if (res / "bench.json").exists():
        bench = json.loads((res / "bench.json").read_text())
        out += [(SPEED, speed_sentence(bench), "\n"), (HEADLINE, headline(bench), "\n"),
                   (COMPILE, compile_note(bench), "")]
    out += [(ROUND, round_table(res), "\n"), (COMPILED_ROUND, compiled_round_table(res), "\n"),
               (SERVE, serve_table(res), "\n"), (BRANCHES, branch_table(res), "\n"),
               (("<!-- threads:start -->", "<!-- threads:end -->"), threads_note(res), ""),
               (SERVING, serving_results(res), "\n"), (RAY, ray_results(res), "\n"), (VLLM, vllm_results(res), "\n"),
               (VLLM_HEADLINE, vllm_headline(res), "\n"),
               (POLICY, policy_table(res), "\n"),
               (SMOLLM2, smollm2_results(res), "\n"), (SMOLLM2_HEADLINE, smollm2_headline(res), "\n"),
               (SMOLLM2_RUN, smollm2_run(res), "\n")]
    return out


def main():
    for page, text in place(blocks()).items():
        if text != page.read_text():
            page.write_text(text)
            print(f"updated {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
