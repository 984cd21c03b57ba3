"""Measure the bundled model for its model card: held-out AR loss, LinearSS tau, loopiness.

    python eval/measure_model.py --model model_cards/recguide-tiny --out model_cards/recguide-tiny/eval_results.json

* held-out AR loss / perplexity per corpus (code, prose) on fixed windows of the held-out files;
* LinearSS mean tokens per round (tau) at B = 8, 16, 32, greedy, 128 new tokens, on HumanEval prompts
  and held-out Shakespeare passages (the engine's own statistics);
* mean distinct-4-gram ratio of the greedy continuations (1.0 = no repeated 4-gram; loops score low);
* whether LinearSS output equalled plain HF greedy for every prompt (lossless check).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prompts import load_prompts  # noqa: E402

import recguide_hf  # noqa: E402
from recguide_hf.cli import load  # noqa: E402


def distinct4(tokens: list[int]) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def heldout_loss(model, tokenizer, corpus_dir: Path, windows: int = 64, seq_len: int = 512) -> dict:
    out = {}
    for name in ("code", "prose"):
        path = corpus_dir / f"{name}_heldout.jsonl"
        if not path.exists():
            continue
        docs = [json.loads(line)["text"] for line in open(path)]
        ids = []
        for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
            ids.extend(enc + [tokenizer.eos_token_id])
        arr = np.asarray(ids)
        starts = np.random.default_rng(0).integers(0, len(arr) - seq_len - 1, size=windows)
        losses = []
        for s in starts:
            x = torch.from_numpy(arr[s:s + seq_len + 1].astype(np.int64))[None]
            logits = model(x[:, :-1]).logits
            losses.append(torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item())
        out[name] = {"ar_loss": float(np.mean(losses)), "perplexity": float(math.exp(np.mean(losses)))}
    return out


def run_set(model, tokenizer, prompts: list[str], block: int, max_new: int, batch: int, check_parity: bool):
    taus, d4, equal, new_tokens, rounds = [], [], True, 0, 0
    for i in tqdm(range(0, len(prompts), batch), desc=f"B={block}", leave=False):
        enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True)
        out = recguide_hf.generate(model, **enc, max_new_tokens=max_new, recguide_mode="linear",
                                   recguide_block_size=block, return_dict_in_generate=True)
        width = enc["input_ids"].shape[1]
        for r, req in enumerate(out.recguide_stats["per_request"]):
            taus.append(req["tau"])
            new_tokens += req["new_tokens"]
            rounds += req["rounds"]
            toks = [t for t in out.sequences[r, width:].tolist() if t != tokenizer.pad_token_id]
            d4.append(distinct4(toks))
        if check_parity:
            ref = model.generate(**enc, max_new_tokens=max_new, recguide_mode="ar", do_sample=False)
            equal &= torch.equal(ref, out.sequences)
    return {"tau": new_tokens / rounds, "tau_mean_per_request": float(np.mean(taus)),
            "distinct4": float(np.mean(d4)), "equal_to_hf_greedy": equal if check_parity else None,
            "num_prompts": len(prompts)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--prose-prompts", type=int, default=64)
    p.add_argument("--humaneval-prompts", type=int, default=164)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--parity-block", type=int, default=16, help="also compare with HF greedy at this B")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32")
    start = time.time()
    result = {"num_parameters": sum(p.numel() for p in model.parameters()), "heldout": heldout_loss(
        model, tokenizer, args.corpus)}
    sets = {"humaneval": load_prompts("humaneval", args.humaneval_prompts),
            "prose": load_prompts("prose", args.prose_prompts)}
    result["linear_ss"] = {}
    for name, prompts in sets.items():
        for block in args.blocks:
            res = run_set(model, tokenizer, prompts, block, args.max_new_tokens, args.batch, block == args.parity_block)
            result["linear_ss"][f"{name}_B{block}"] = res
            print(name, block, json.dumps(res), flush=True)
    result["seconds"] = time.time() - start
    result["command"] = "python " + " ".join(sys.argv)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
