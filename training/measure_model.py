"""Measure the bundled model for its model card: held-out AR loss, LinearSS tau, loopiness.

    python training/measure_model.py --model recguide_hf/bundled/recguide-tiny \
        --out recguide_hf/bundled/recguide-tiny/eval_results.json

* held-out AR loss / perplexity per corpus (code, prose) on fixed windows of the held-out files;
* LinearSS mean tokens per round (tau) at B = 8, 16, 32, greedy, 128 new tokens, on HumanEval prompts
  and held-out Shakespeare passages (the engine's own round log);
* novel-text tau: the same mean over rounds none of whose emitted tokens completes an 8-gram that already
  occurs earlier in that sequence (prompt included), so a reader sees how much of tau is loops;
* the acceptance profile: P(first k drafts accepted), k = 1..8, over full-size rounds;
* mean distinct-4-gram ratio of the greedy continuations (1.0 = no repeated 4-gram; loops score low);
* whether LinearSS output equalled plain HF greedy for every prompt (lossless check);
* sampling (temperature 0.8, LinearSS at `--parity-block`): TPF and tau.
* LinearSS at `--first-draft-block` with `recguide_first_draft="verifier"` (d_1 from the seed's own causal
  logits), beside the default.

`--no-adapter` measures the folder without its drafting adapter (`draft_lora/`): the drafter before it.
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

import recguide_hf
from recguide_hf.core.config import DecodingConfig
from recguide_hf.core.engine import Engine, SamplingSettings
from recguide_hf.models.registry import as_backbone
from recguide_hf.tools.cli import load
from recguide_hf.tools.prompts import load_prompts


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


def novel_rounds(tokens: list[int], spans: list[tuple[int, int]], n: int = 8) -> list[bool]:
    """For each round's span [start, end) of `tokens`: True when no token in it completes an n-gram that already
    occurs earlier in `tokens` (an earlier start)."""
    first_seen: dict[tuple, int] = {}
    repeat_end = [False] * len(tokens)  # token i completes an n-gram seen before
    for i in range(n - 1, len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1])
        if gram in first_seen:
            repeat_end[i] = True
        else:
            first_seen[gram] = i
    return [not any(repeat_end[a:b]) for a, b in spans]


def run_set(model, tokenizer, prompts: list[str], block: int, max_new: int, batch: int, check_parity: bool,
            first_draft: str = "mask"):
    """LinearSS at `block` through the engine with its round log: tau, novel-text tau, acceptance profile."""
    eos = model.generation_config.eos_token_id
    emitted, novel, accepted, d4, equal = [], [], [], [], True
    for i in tqdm(range(0, len(prompts), batch), desc=f"B={block}", leave=False):
        enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True)
        settings = SamplingSettings(max_new_tokens=max_new, eos_token_ids=[eos], pad_token_id=tokenizer.pad_token_id)
        engine = Engine(as_backbone(model), DecodingConfig(mode="linear", block_size=block, first_draft=first_draft),
                        settings)
        seqs, stats = engine.generate(enc["input_ids"], enc["attention_mask"], log_rounds=True)
        width = enc["input_ids"].shape[1]
        per_row: dict[int, list[tuple[int, int]]] = {}
        for row, _, n, k, _, _ in stats.round_log:
            per_row.setdefault(row, []).append((n, k))
        for r, rounds in per_row.items():
            count = int(stats.new_tokens[r])
            prompt = enc["input_ids"][r][enc["attention_mask"][r].bool()].tolist()
            toks = seqs[r, width:width + count].tolist()
            spans, start = [], len(prompt)
            for n, k in rounds:
                end = min(start + n + 1, len(prompt) + count)
                spans.append((start, end))
                start = end
                if k == block - 1:  # a full-size round: its accepted count is the acceptance profile
                    accepted.append(n)
            flags = novel_rounds(prompt + toks, spans)
            emitted += [b - a for a, b in spans]
            novel += [b - a for (a, b), f in zip(spans, flags) if f]
            d4.append(distinct4(toks))
        if check_parity:
            ref = model.generate(**enc, max_new_tokens=max_new, recguide_mode="ar", do_sample=False)
            equal &= torch.equal(ref[:, :seqs.shape[1]], seqs) and ref.shape == seqs.shape
    acc = np.asarray(accepted)
    return {"tau": float(np.mean(emitted)), "novel_tau": float(np.mean(novel)) if novel else None,
            "novel_round_share": len(novel) / len(emitted),
            "accept_profile": [float((acc >= k).mean()) for k in range(1, 9)] if len(acc) else None,
            "distinct4": float(np.mean(d4)), "equal_to_hf_greedy": equal if check_parity else None,
            "num_prompts": len(prompts), "rounds": len(emitted)}


def sampling(model, tokenizer, prompts: list[str], block: int, max_new: int, batch: int, temperature: float) -> dict:
    torch.manual_seed(0)
    new = fwd = rounds = 0
    for i in range(0, len(prompts), batch):
        enc = tokenizer(prompts[i:i + batch], return_tensors="pt", padding=True)
        s = recguide_hf.generate(model, **enc, max_new_tokens=max_new, recguide_mode="linear", do_sample=True,
                                 temperature=temperature, recguide_block_size=block,
                                 return_dict_in_generate=True).recguide_stats
        new, fwd, rounds = new + s["new_tokens"], fwd + s["request_forwards"], rounds + s["rounds"]
    return {"temperature": temperature, "block": block, "tpf": new / fwd, "tau": new / rounds,
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
    p.add_argument("--no-adapter", action="store_true", help="without the folder's drafting adapter (draft_lora/)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling run (0: none)")
    p.add_argument("--first-draft-block", type=int, default=16,
                   help="also LinearSS with recguide_first_draft='verifier' at this B (0: not)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    tokenizer, model = load(args.model, "fp32", **({"draft_adapter": False} if args.no_adapter else {}))
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
        if args.first_draft_block:
            block = args.first_draft_block
            res = run_set(model, tokenizer, prompts, block, args.max_new_tokens, args.batch, True, "verifier")
            result.setdefault("first_draft_verifier", {})[f"{name}_B{block}"] = res
            print(name, block, "first_draft=verifier", json.dumps(res), flush=True)
        if args.temperature > 0:
            res = sampling(model, tokenizer, prompts, args.parity_block, args.max_new_tokens, args.batch,
                           args.temperature)
            result.setdefault("sampling", {})[name] = res
            print(name, "sampling", json.dumps(res), flush=True)
    result["seconds"] = time.time() - start
    result["command"] = "python " + " ".join(sys.argv)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
