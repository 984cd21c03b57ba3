"""SmolLM2 as shipped: the issue's chat prompt through `recguide generate --model smollm2` against the base's HF greedy
output (acceptance by decoding on held-out prompts: eval/engine_tau.py).

    python eval/smollm2_check.py --out eval/results/smollm2/check.json
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

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    fetch("smollm2")  # the folder `recguide generate --model smollm2` runs (made once)
    report = {"folder": "$(recguide fetch smollm2)"}

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
