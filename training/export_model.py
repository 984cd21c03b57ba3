"""Turn a training run's final folder into the Hub model folder (weights, tokenizer, code shims, configs).

    python training/export_model.py runs/joint/final recguide_hf/bundled/recguide-tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from recguide_hf.models.export import save_model_folder
from recguide_hf.models.modeling import RecGuideForCausalLM


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_folder", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    model = RecGuideForCausalLM.from_pretrained(args.run_folder, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(args.run_folder)
    save_model_folder(model, tokenizer, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
