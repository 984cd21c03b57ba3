"""SmolLM2 as shipped: tau of the stored (bf16) drafting adapter on the training run's held-out rows, and the issue's
chat prompt through `recguide generate --model smollm2` against the base's HF greedy output.

    python eval/smollm2_check.py --work runs/smollm2/work --out eval/results/smollm2/check.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

PROMPT = "Write a Python function that reverses a string."


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recguide_hf.models.known import base_folder, fetch
    from recguide_hf.tools.distill.loop import AdapterStudent, heldout_taus, load_rows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="the training run's work folder (held-out rows)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    folder = fetch("smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    student = AdapterStudent.attached(model)
    report = {"folder": str(folder), "shipped_adapter_taus": {}}
    for path in sorted((args.work / "teacher").glob("heldout_*.npz")):
        x, lo, valid = load_rows(path)
        report["shipped_adapter_taus"][path.stem.removeprefix("heldout_")] = heldout_taus(student, model, x, lo, valid)
    trained = json.loads((args.work / "run" / "final" / "distill_log.json").read_text())["log"][-1]
    report["trained_adapter_taus_fp32"] = {k: v for k, v in trained.items() if k.startswith("tau_")}

    tok = AutoTokenizer.from_pretrained(base_folder("smollm2"))
    base = AutoModelForCausalLM.from_pretrained(base_folder("smollm2"), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    expected = base.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids["input_ids"].shape[1]:]
    runs = {}
    for mode in ("recguide", "ar"):
        cmd = ["recguide", "generate", "--model", "smollm2", "--prompt", PROMPT, "--max-new-tokens",
               str(args.max_new_tokens), "--mode", mode]
        shown = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ).stdout
        result = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True,
                                           env=os.environ).stdout.strip().splitlines()[-1])
        runs[mode] = {"command": " ".join(cmd), "printed": shown, "equal_to_hf_greedy": result["new_ids"] ==
                      expected.tolist(), **{k: result.get(k) for k in ("tokens_per_s", "tpf", "tau", "block_sizes")}}
    report["generate"] = runs
    report["hf_greedy_text"] = tok.decode(expected, skip_special_tokens=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0 if all(r["equal_to_hf_greedy"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
