"""The verifier's own greedy continuations: what a drafting adapter is distilled on (and measured against).

A file of teacher rows holds `tokens` [N, L] (each row `[prompt | continuation]`, right-padded with the pad id),
`lo` [N] (the prompt's length: draft blocks are anchored at or after it) and `valid` [N] (prompt + continuation
length); a continuation ends after the first EOS. Batches are left-padded for generation only; the rows are stored
unpadded on the left, so a causal pass over a row sees exactly the prompt and continuation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ...core.masks import left_pad


@torch.no_grad()
def continue_greedily(model, prompts: list[list[int]], new_tokens: int, pad_id: int,
                      eos_ids: list[int]) -> list[list[int]]:
    """Argmax-greedy continuations of a batch of prompts (left-padded, HF `generate`), each cut after its first EOS.
    The generation config is a fresh one: none of the base's own extras (a repetition penalty, say) applies, so the
    rows are the tokens RecGuide's lossless greedy decoding reproduces."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids, attn = left_pad(prompts, pad_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                         generation_config=config)[:, ids.shape[1]:].tolist()
    cut = []
    for row in out:
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        cut.append(row[:ends[0] + 1] if ends else row)
    return cut


def write_rows(path: Path, prompts: list[list[int]], conts: list[list[int]], pad_id: int, info: dict) -> dict:
    width = max(len(p) + len(c) for p, c in zip(prompts, conts))
    tokens = np.full((len(prompts), width), pad_id, dtype=np.int32)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        tokens[i, :len(p) + len(c)] = p + c
    lo = np.array([len(p) for p in prompts], dtype=np.int32)
    valid = lo + np.array([len(c) for c in conts], dtype=np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=tokens, lo=lo, valid=valid)
    info = {**info, "rows": len(prompts), "continuation_tokens": int((valid - lo).sum())}
    path.with_suffix(".json").write_text(json.dumps(info, indent=1))
    return info


def train_shards(teacher: Path) -> list[Path]:
    """The training rows' files in the order they were made: `train.npz`, then `train_2.npz`, `train_3.npz`... (a
    later `recguide distill` with a larger `--teacher-minutes` adds one)."""
    more = sorted(teacher.glob("train_*.npz"), key=lambda p: int(p.stem.split("_")[1]))
    return ([teacher / "train.npz"] if (teacher / "train.npz").exists() else []) + more


def shards_info(teacher: Path) -> dict:
    """The shards' `train*.json` records summed: seconds, prompts offered, rows, continuation tokens, shards."""
    infos = [json.loads(p.with_suffix(".json").read_text()) for p in train_shards(teacher)]
    total = {k: sum(i.get(k, 0) for i in infos) for k in ("seconds", "prompts_offered",
                                                          "rows_with_mask_token_dropped", "rows",
                                                          "continuation_tokens")}
    return {**(infos[0] if infos else {}), **total, "seconds": round(total["seconds"], 1), "shards": len(infos)}


def prompts_in(path: Path) -> set[tuple[int, ...]]:
    blob = np.load(path)
    return {tuple(row[:lo].tolist()) for row, lo in zip(blob["tokens"], blob["lo"])}


class Offers:
    """`teacher/offers.json`: the training-prompt offers (`--teacher-prompts`, `--chat-share`, `--seed`) whose every
    prompt was continued, and the prompts whose rows were dropped for the MASK token, so that a later `recguide
    distill` with budget left neither rebuilds an offer already made nor continues a dropped prompt again."""

    def __init__(self, teacher: Path):
        self.path = teacher / "offers.json"
        blob = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.made: list[dict] = blob.get("made", [])
        self.dropped: set[tuple[int, ...]] = {tuple(p) for p in blob.get("dropped", [])}

    def record(self, offer: dict | None = None, dropped: list[list[int]] = ()) -> None:
        if offer is not None and offer not in self.made:
            self.made.append(offer)
        self.dropped |= {tuple(p) for p in dropped}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"made": self.made, "dropped": sorted(map(list, self.dropped))}))


def stop_ids(model, tokenizer) -> tuple[list[int], int]:
    """(EOS ids, pad id) the teacher rows were made with: the generation config's EOS (else the tokenizer's), the
    tokenizer's pad (else the first EOS). Decoding that must reproduce the rows uses the same."""
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
        else tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def make_teacher_rows(model, tokenizer, prompts: list[list[int]], out: Path, new_tokens: int = 128,
                      batch_size: int = 16, minutes: float | None = None, mask_id: int | None = None) -> dict:
    """Continue `prompts` (in batches of similar length) until done or `minutes` pass; write the rows to `out`."""
    eos_ids, pad_id = stop_ids(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    np.random.default_rng(0).shuffle(batches)  # similar lengths within a batch, every length across the run
    done_p, done_c, dropped = [], [], []
    t0 = time.time()
    bar = tqdm(batches, desc="teacher rows", unit="batch", mininterval=10)
    for batch in bar:
        if minutes is not None and time.time() - t0 > minutes * 60:
            break
        ps = [prompts[i] for i in batch]
        for p, c in zip(ps, continue_greedily(model, ps, new_tokens, pad_id, eos_ids)):
            if mask_id in c:  # the base itself emits the MASK token: RecGuide suppresses it, so it would not match
                dropped.append(p)
                continue
            done_p.append(p)
            done_c.append(c)
        bar.set_postfix(rows=len(done_p))
    bar.close()
    if dropped:
        print(f"warning: the base's greedy output held the MASK token (id {mask_id}) in {len(dropped)} rows "
              "(dropped): outputs that would hold it differ from the base's; choose another --mask-token", flush=True)
    info = {"seconds": round(time.time() - t0, 1), "new_tokens": new_tokens, "prompts_offered": len(prompts),
            "rows_with_mask_token_dropped": len(dropped)}
    # nothing to write (every row dropped, or no time): no empty file
    info = write_rows(out, done_p, done_c, pad_id, info) if done_p else {**info, "rows": 0, "continuation_tokens": 0}
    return {**info, "dropped_prompts": dropped}  # not in the file: the caller may record them (`Offers`)


class TeacherRows:
    """Random batches of teacher rows (one or more files), as `(tokens [B, L], lo [B], valid [B])`, trimmed to
    the batch's longest row."""

    def __init__(self, paths: list[Path], batch_size: int, seed: int):
        blobs = [np.load(p) for p in paths]
        width = max(b["tokens"].shape[1] for b in blobs)
        self.tokens = torch.cat([torch.nn.functional.pad(torch.from_numpy(b["tokens"].astype(np.int64)),
                                                         (0, width - b["tokens"].shape[1])) for b in blobs])
        self.lo = torch.from_numpy(np.concatenate([b["lo"] for b in blobs]).astype(np.int64))
        self.valid = torch.from_numpy(np.concatenate([b["valid"] for b in blobs]).astype(np.int64))
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def next(self):
        idx = torch.from_numpy(self.rng.integers(0, len(self.tokens), size=self.batch_size))
        valid = self.valid[idx]
        return self.tokens[idx, :int(valid.max())], self.lo[idx], valid
