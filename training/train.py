"""Train the embedded self-speculative model (AR pre-training, then joint AR + block-diffusion).

    python training/train.py --phase ar --minutes 30 --run runs/ar
    python training/train.py --phase joint --minutes 65 --init runs/ar/final --run runs/joint
    python training/teacher_data.py --teacher runs/joint/final --minutes 9 --out data/distill/teacher.npz
    python training/train.py --phase distill --minutes 35 --init runs/joint/final --run runs/distill --lr 5e-4
    python training/export_model.py runs/joint/final recguide_hf/bundled/recguide-tiny

Budgets are wall-clock minutes (the learning-rate schedule follows elapsed time), checkpoints are written
every `--ckpt-minutes` and `--resume` continues a run. bf16 autocast is on by default (`--dtype fp32` to
turn it off); `--device cuda` trains on a GPU.

Diffusion loss (the drafter): after the clean causal pass writes the keys/values of the whole sequence,
a second pass over K draft blocks `[x_t, MASK x (B-1)]` (a quarter of them `[MASK x B]`, the continuation
shape) attends to the clean keys before t and bidirectionally to its own block; a MASK position is trained
to predict the token AT its position, weighted 1/sqrt(i) towards the block start (acceptance is a prefix).
The clean keys are computed once on the fast causal path instead of in a doubled [clean | noisy] sequence.

Distillation (`--phase distill`, docs/algorithm.md §5): the drafter learns the FROZEN teacher's greedy continuations
(what acceptance measures), cut before loops by training/teacher_data.py; draft blocks are anchored inside the
continuation and the AR loss is held on the real-text prompt of each row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer, DynamicCache

from recguide_hf.core.masks import additive_mask
from recguide_hf.models.modeling import RecGuideConfig, RecGuideForCausalLM
from recguide_hf.tools.distill.loop import draft_blocks, set_lr  # noqa: F401  (shared with `recguide distill`)

MODEL_CONFIG = dict(  # ~12M parameters; sized so ~100 CPU minutes see a few epochs of the corpus
    hidden_size=320, intermediate_size=960, num_hidden_layers=8, num_attention_heads=5,
    num_key_value_heads=5, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, block_size=16,
)


def load_tokens(corpus: Path, tokenizer, split: str) -> dict[str, np.ndarray]:
    """Token ids per corpus, documents separated by EOS, cached as .npy next to the corpus."""
    out = {}
    for name in ("code", "prose"):
        cache = corpus / f"{name}_{split}.v{len(tokenizer)}.npy"
        if not cache.exists():
            docs = [json.loads(line)["text"] for line in open(corpus / f"{name}_{split}.jsonl")]
            ids = []
            for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
                ids.extend(enc + [tokenizer.eos_token_id])
            np.save(cache, np.asarray(ids, dtype=np.int32))
        out[name] = np.load(cache)
    return out


class Batches:
    """Random windows of `seq_len + 1` tokens from both corpora, weighted by corpus size."""

    def __init__(self, tokens: dict[str, np.ndarray], seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        sizes = np.array([len(t) for t in tokens.values()], dtype=np.float64)
        self.weights = sizes / sizes.sum()

    def next(self) -> torch.Tensor:
        names = list(self.tokens)
        rows = []
        for _ in range(self.batch_size):
            arr = self.tokens[names[self.rng.choice(len(names), p=self.weights)]]
            start = self.rng.integers(0, len(arr) - self.seq_len - 1)
            rows.append(arr[start:start + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))  # [N, L+1]


class TeacherBatches:
    """Rows of frozen-teacher data (training/teacher_data.py): real-text prompt + the teacher's greedy continuation."""

    def __init__(self, paths: Path | list[Path], batch_size: int, seed: int):
        blobs = [np.load(p) for p in ([paths] if isinstance(paths, Path) else paths)]
        shapes = {(int(b["prompt_len"]), b["tokens"].shape[1]) for b in blobs}
        if len(shapes) != 1:
            raise ValueError(f"teacher-data files differ in (prompt length, row length): {sorted(shapes)}")
        self.tokens = torch.from_numpy(np.concatenate([b["tokens"] for b in blobs]).astype(np.int64))
        self.valid = torch.from_numpy(np.concatenate([b["valid"] for b in blobs]).astype(np.int64))
        self.prompt_len = int(blobs[0]["prompt_len"])
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(self.rng.integers(0, len(self.tokens), size=self.batch_size))
        return self.tokens[idx], self.valid[idx]


def losses(model, x: torch.Tensor, phase: str, args, gen: torch.Generator, dtype) -> dict[str, torch.Tensor]:
    if phase == "distill":  # x = (teacher rows, valid lengths)
        return distill_losses(model, *x, args, gen, dtype)
    inputs, targets = x[:, :-1], x[:, 1:]
    if phase == "ar":
        logits = model(input_ids=inputs).logits
        return {"ar": F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())}
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=inputs, cache=cache, use_cache=True).logits
    return {"ar": F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()),
            "diff": diffusion_loss(model, cache, inputs, args, gen, dtype)}


def distill_losses(model, x, valid, args, gen, dtype) -> dict[str, torch.Tensor]:
    """AR loss on the real-text prompt only (held), diffusion loss on blocks inside the teacher's continuation."""
    p = args.prompt_len
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=x, cache=cache, use_cache=True).logits
    return {"ar": F.cross_entropy(logits[:, :p - 1].flatten(0, 1).float(), x[:, 1:p].flatten()),
            "diff": diffusion_loss(model, cache, x, args, gen, dtype, lo=p, valid=valid)}


def diffusion_loss(model, cache, x, args, gen, dtype, lo: int = 1, valid=None) -> torch.Tensor:
    """Weighted CE of draft blocks over clean sequences x whose keys/values `cache` already holds."""
    b = random.choice(args.block_sizes)
    k = max(1, args.draft_tokens // b)
    ids, pos, labels, weights, allowed = draft_blocks(x, b, k, model.config.mask_token_id, gen, lo=lo, valid=valid)
    mask = additive_mask(allowed.to(x.device), dtype=dtype)
    dlogits = model(input_ids=ids.to(x.device), position_ids=pos.to(x.device), attention_mask=mask,
                    cache=cache, use_cache=True).logits
    ce = F.cross_entropy(dlogits.flatten(0, 1).float(), labels.to(x.device).flatten(), reduction="none")
    w = weights.to(x.device).flatten()
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


@torch.no_grad()
def evaluate(model, tokens: dict[str, np.ndarray], args, dtype, device) -> dict[str, float]:
    """Held-out AR loss per corpus and diffusion loss, on fixed windows."""
    model.eval()
    res = {}
    gen = torch.Generator().manual_seed(1234)
    for name, arr in tokens.items():
        rng = np.random.default_rng(0)
        starts = rng.integers(0, len(arr) - args.seq_len - 1, size=args.eval_windows)
        x = torch.from_numpy(np.stack([arr[s:s + args.seq_len + 1] for s in starts]).astype(np.int64)).to(device)
        ar, diff = [], []
        for chunk in x.split(8):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = losses(model, chunk, "joint", args, gen, dtype)
            ar.append(out["ar"].item())
            diff.append(out["diff"].item())
        res[f"heldout_ar_{name}"] = float(np.mean(ar))
        res[f"heldout_diff_{name}"] = float(np.mean(diff))
    model.train()
    return res


def save_ckpt(path: Path, model, opt, state: dict):
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                "rng": torch.get_rng_state(), "py_rng": random.getstate()}, path / "ckpt.pt.tmp")
    os.replace(path / "ckpt.pt.tmp", path / "ckpt.pt")


def train(args):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_tokens = load_tokens(args.corpus, tokenizer, "train")
    held_tokens = load_tokens(args.corpus, tokenizer, "heldout")
    if args.init:
        model = RecGuideForCausalLM.from_pretrained(args.init)
    else:
        config = RecGuideConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                mask_token_id=tokenizer.mask_token_id, **MODEL_CONFIG)
        model = RecGuideForCausalLM(config)
    model.to(device).train()
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "log": []}
    ckpt = args.run / "ckpt.pt"
    if args.resume and ckpt.exists():
        blob = torch.load(ckpt, weights_only=False)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["opt"])
        state = blob["state"]
        torch.set_rng_state(blob["rng"])
        random.setstate(blob["py_rng"])
    if args.phase == "distill":
        batches = TeacherBatches(args.teacher_data, args.batch_size, args.seed + state["step"])
        args.prompt_len = batches.prompt_len
    else:
        batches = Batches(train_tokens, args.seq_len, args.batch_size, args.seed + state["step"])
    gen = torch.Generator().manual_seed(args.seed + state["step"])
    budget = args.minutes * 60
    print(f"{num_params / 1e6:.2f}M parameters, phase {args.phase}, budget {args.minutes} min", flush=True)
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), unit="s", desc=args.phase, mininterval=10)
    last_ckpt = last_eval = time.time()
    t0 = time.time() - state["elapsed"]
    while state["elapsed"] < budget:
        set_lr(opt, args.lr, state["step"], args.warmup, state["elapsed"] / budget)
        x = batches.next()
        x = tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            parts = losses(model, x, args.phase, args, gen, dtype)
        loss = parts["ar"] + args.diff_weight * parts.get("diff", 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += x[0].numel() if isinstance(x, tuple) else x.numel()
        now = time.time()
        state["elapsed"] = now - t0
        bar.update(int(state["elapsed"]) - bar.n)
        if state["step"] % 20 == 0:
            shown = {k: f"{v.item():.3f}" for k, v in parts.items()}
            bar.set_postfix(shown | {"tok/s": int(state["tokens"] / state["elapsed"])})
        if now - last_eval > args.eval_minutes * 60:
            metrics = evaluate(model, held_tokens, args, dtype, device)
            state["log"].append({"step": state["step"], "elapsed": state["elapsed"], "tokens": state["tokens"],
                                 "train": {k: v.item() for k, v in parts.items()}, **metrics})
            print(json.dumps(state["log"][-1]), flush=True)
            last_eval = time.time()
        if now - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(args.run, model, opt, state)
            last_ckpt = time.time()
    bar.close()
    metrics = evaluate(model, held_tokens, args, dtype, device)
    state["log"].append({"step": state["step"], "elapsed": state["elapsed"], "tokens": state["tokens"], **metrics})
    print("final", json.dumps(state["log"][-1]), flush=True)
    save_ckpt(args.run, model, opt, state)
    model.save_pretrained(args.run / "final")
    tokenizer.save_pretrained(args.run / "final")
    with open(args.run / "final" / "train_log.json", "w") as f:
        json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "num_params": num_params, **state}, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["ar", "joint", "distill"], default="ar")
    p.add_argument("--teacher-data", type=Path, default=Path("data/distill/teacher.npz"),
                   help="frozen-teacher continuations for --phase distill (training/teacher_data.py)")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--run", type=Path, default=Path("runs/ar"))
    p.add_argument("--init", type=Path, default=None, help="start from this saved model folder")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("recguide_hf/bundled/recguide-tiny"))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 16, 32])
    p.add_argument("--draft-tokens", type=int, default=256, help="draft-block tokens per sequence (joint)")
    p.add_argument("--diff-weight", type=float, default=1.0)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--eval-minutes", type=float, default=10)
    p.add_argument("--ckpt-minutes", type=float, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
