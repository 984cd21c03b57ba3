r"""Average drafting adapters continued from one adapter: each LoRA's A and B, uniformly (a "soup").

    python training/average_adapters.py --out OUT runs/draft_lora_s12 runs/adapter14/final \
        --labels "the adapter of commit 4f89065" "its continuation (runs/adapter14)"

Every input must be a PEFT LoRA folder of the same shapes (training/distill.py's `final/` or an exported draft_lora/).
The inputs should share their start (one continued from the other, or both from a common adapter): A and B are
averaged separately, so the product B A is near the average of the products only while the adapters are near
each other. The output keeps the last input's adapter_config.json and distill_log.json (its training curve) and
records the average there (`averaged_from`), so the model card says what the weights are.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def average(folders: list[Path], out: Path, labels: list[str] | None = None) -> dict:
    """Write the uniform average of `folders`' adapters to `out`; returns the `averaged_from` record (`labels`:
    what each input is, for the model card, e.g. the commit that shipped it)."""
    weights = [load_file(f / "adapter_model.safetensors") for f in folders]
    keys = weights[0].keys()
    for f, w in zip(folders, weights):
        if w.keys() != keys or any(w[k].shape != weights[0][k].shape for k in keys):
            raise ValueError(f"{f}: its adapter does not have {folders[0]}'s tensors and shapes")
    mean = {k: (sum(w[k].double() for w in weights) / len(weights)).to(weights[0][k].dtype).contiguous()
            for k in keys}
    logs = [json.loads((f / "distill_log.json").read_text()) if (f / "distill_log.json").exists() else None
            for f in folders]
    record = {"inputs": [str(f) for f in folders],
              "minutes": [log["log"][-1]["minutes"] if log else None for log in logs],
              "rule": "uniform mean of each lora_A and lora_B tensor"}
    if labels:
        if len(labels) != len(folders):
            raise ValueError(f"{len(labels)} labels for {len(folders)} adapters")
        record["labels"] = list(labels)
    staging = out.with_name(out.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(folders[-1], staging)
    save_file(mean, staging / "adapter_model.safetensors", metadata={"format": "pt"})
    if logs[-1] is not None:
        log = dict(logs[-1], averaged_from=record)
        (staging / "distill_log.json").write_text(json.dumps(log, indent=1))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", type=Path, nargs="+", help="adapter folders (the last one's config and log are kept)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--labels", nargs="+", help="what each input is (the model card names them so), one per input")
    args = p.parse_args(argv)
    if len(args.inputs) < 2:
        p.error("give two or more adapter folders")
    torch.set_num_threads(1)
    record = average(args.inputs, args.out, args.labels)
    print(f"averaged {len(args.inputs)} adapters -> {args.out}: {json.dumps(record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
