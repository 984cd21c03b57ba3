"""The tau curve of a `recguide distill` run: held-out tau(B) against the CPU-hours of training, as a plot and a table.

    python eval/tau_curve.py recguide_hf/bundled/smollm2/draft_lora/distill_log.json --out eval/results/smollm2

Reads the log the distiller writes beside the adapter (`draft_lora/distill_log.json`): one entry per measurement,
with `cpu_hours` (the training process's CPU time, measuring excluded) and `tau_B{4,8,16}_{set}` on held-out rows.
Writes `tau_curve.png` and `tau_curve.md` (the table, and tau gained per CPU-hour over the last interval at B = 8).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BLOCKS = (4, 8, 16)


def table(log: list[dict]) -> str:
    sets = sorted({k.rsplit("_", 1)[1] for k in log[-1] if k.startswith("tau_B")})
    head = "| minutes | CPU-hours | steps | " + " | ".join(f"{s} B={b}" for s in sets for b in BLOCKS) + " |"
    rule = "|" + "---|" * (3 + len(sets) * len(BLOCKS))
    rows = [f"| {e['minutes']:.0f} | {e['cpu_hours']:.2f} | {e['step']} | "
            + " | ".join(f"{e[f'tau_B{b}_{s}']:.2f}" for s in sets for b in BLOCKS) + " |" for e in log]
    return "\n".join([head, rule, *rows])


def gains(log: list[dict]) -> dict[str, float]:
    """tau(B = 8) gained per CPU-hour between the last two measurements, per held-out set."""
    if len(log) < 2:
        return {}
    a, b = log[-2], log[-1]
    hours = b["cpu_hours"] - a["cpu_hours"]
    sets = sorted({k.rsplit("_", 1)[1] for k in b if k.startswith("tau_B8_")})
    return {s: round((b[f"tau_B8_{s}"] - a[f"tau_B8_{s}"]) / hours, 3) for s in sets if hours > 0}


def plot(log: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({k.rsplit("_", 1)[1] for k in log[-1] if k.startswith("tau_B")})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = [e["cpu_hours"] for e in log]
    for s, style in zip(sets, ("-", "--", ":")):
        for b, color in zip(BLOCKS, ("tab:blue", "tab:orange", "tab:green")):
            ax.plot(x, [e[f"tau_B{b}_{s}"] for e in log], style, color=color, marker="o", ms=3, label=f"{s}, B={b}")
    ax.set_xlabel("training CPU-hours (process CPU time, measuring excluded)")
    ax.set_ylabel("held-out tau(B)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="SmolLM2-135M-Instruct drafting LoRA")
    args = p.parse_args(argv)
    log = json.loads(args.log.read_text())["log"]
    args.out.mkdir(parents=True, exist_ok=True)
    plot(log, args.out / "tau_curve.png", args.title)
    per_hour = gains(log)
    text = (f"Command: `python eval/tau_curve.py {args.log} --out {args.out}`\n\n{table(log)}\n\n"
            f"tau(B = 8) gained per CPU-hour over the last interval: "
            + ", ".join(f"{s} {v:+.2f}" for s, v in per_hour.items()) + "\n")
    (args.out / "tau_curve.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
