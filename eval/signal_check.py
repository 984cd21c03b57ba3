"""Which per-request signal predicts the next round's progress? (the auto policy's value table reads one)

    python eval/signal_check.py --block 16 --out eval/results/signal_check.json

LinearSS at a large block (as `recguide calibrate` runs it, on the calibration prompts: held-out code and
prose, skipping the first 100 of each) logs every round's accepted drafts n_t and verifier entropy e_t. The
progress a round at block B would have made is min(n_t, B - 1) + 1 (acceptance is a prefix). Each signal
below is fitted to it by least squares on 4 of 5 folds of requests and scored on the fifth (out of fold R^2;
0 = no better than the mean, below 0 = worse):
* `certainty`: s_t = -(e_{t-1} + e_{t-2}) / 2, what the value table bins (docs/algorithm.md §2.3);
* `full`: the previous round fully accepted at block B (the F of the state z = (B, F));
* `accepted`: n_{t-1}, and `accepted_2`: n_{t-1} and n_{t-2}, each censored at B - 1 as a round at B would see;
* `certainty+accepted_2`: all three.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.models.registry import as_backbone
from recguide_hf.tools.bench import save_run
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_prompts

SIGNALS = {"certainty": [0], "full": [1], "accepted": [2], "accepted_2": [2, 3], "certainty+accepted_2": [0, 2, 3]}


def round_logs(model, tokenizer, sets, num_prompts: int, skip: int, max_new: int, batch: int = 8):
    """{(set, request): [(accepted, entropy), ...]} from LinearSS at B = 64."""
    eos = model.generation_config.eos_token_id
    logs = {}
    for name in sets:
        prompts = load_prompts(name, skip + num_prompts)[skip:]
        for i in range(0, len(prompts), batch):
            enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True)
            engine = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=64),
                            SamplingSettings(max_new_tokens=max_new, eos_token_ids=[eos],
                                             pad_token_id=tokenizer.pad_token_id))
            _, stats = engine.generate(enc["input_ids"], enc["attention_mask"], log_rounds=True)
            for row, _, accepted, _, entropy, _ in stats.round_log:
                logs.setdefault((name, i + row), []).append((accepted, entropy))
    return logs


def out_of_fold_r2(features: np.ndarray, target: np.ndarray, fold: np.ndarray) -> float:
    pred = np.zeros_like(target)
    for f in np.unique(fold):
        train, test = fold != f, fold == f
        weights = np.linalg.lstsq(np.c_[np.ones(train.sum()), features[train]], target[train], rcond=None)[0]
        pred[test] = np.c_[np.ones(test.sum()), features[test]] @ weights
    return float(1 - ((target - pred) ** 2).mean() / target.var())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--block", type=int, default=16, help="the block size whose progress is predicted")
    p.add_argument("--sets", nargs="+", default=["code", "prose"])
    p.add_argument("--num-prompts", type=int, default=32, help="per set")
    p.add_argument("--skip", type=int, default=100, help="as `recguide calibrate`: past the bench's prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32")
    logs = round_logs(model, tokenizer, args.sets, args.num_prompts, args.skip, args.max_new_tokens)
    b = args.block
    rows, fold = [], []
    for k, seq in enumerate(logs.values()):
        for t in range(2, len(seq)):
            n1, n2 = min(seq[t - 1][0], b - 1), min(seq[t - 2][0], b - 1)
            rows.append((min(seq[t][0], b - 1) + 1, -(seq[t - 1][1] + seq[t - 2][1]) / 2, float(n1 == b - 1), n1, n2))
            fold.append(k % 5)
    data = np.array(rows, dtype=float)
    target, features, fold = data[:, 0], data[:, 1:], np.array(fold)
    r2 = {name: round(out_of_fold_r2(features[:, cols], target, fold), 3) for name, cols in SIGNALS.items()}
    print(f"{len(target)} rounds of {len(logs)} requests; mean progress at B = {b}: {target.mean():.2f}")
    for name, value in r2.items():
        print(f"  out-of-fold R^2 {name}: {value}")
    save_run(args.out, {"block": b, "rounds": len(target), "requests": len(logs),
                        "mean_progress": round(float(target.mean()), 3), "r2": r2})


if __name__ == "__main__":
    main()
