"""Greedy continuations of a FROZEN teacher for distilling the drafter (docs/algorithm.md §5).

    python training/teacher_data.py --teacher recguide_hf/bundled/recguide-tiny --minutes 8 \\
        --out data/distill/teacher.npz

Prompts are random windows of the TRAINING split (never held-out text, never HumanEval); with
`--docstring-share f`, a fraction f of the code windows instead END where a function's docstring closes (a
line ending in triple quotes within 64 tokens of a `def`), the shape of a HumanEval-style prompt, so the
teacher writes function bodies as an evaluation request asks it to. The teacher continues
each one greedily (bf16 autocast by default, static KV cache, batched; a trainer that needs exact fp32 greedy
labels recomputes them from the frozen teacher's teacher-forced logits). Every continuation is cut after an EOS.

`--keep-loops` (the default) keeps everything else: a drafting ADAPTER trained beside a frozen verifier cannot
collapse, and at inference the verifier does loop, so the drafter must predict the loops too. With
`--no-keep-loops` (what distilling the SHARED weights needed) a continuation is also cut where its first
repeated 8-gram starts again and kept only when at least `--min-kept` tokens remain, their distinct 4-gram
ratio reaches `--min-distinct` and they are not mostly newlines or whitespace. The file holds `tokens`
[N, P + G] (padded with PAD after the cut), `prompt_len` P and `valid` [N] (prompt + kept continuation
length), plus what was dropped and why.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from measure_model import distinct4
from tqdm import tqdm
from train import load_tokens
from transformers import AutoTokenizer, StaticCache

from recguide_hf.models.modeling import RecGuideForCausalLM


def docstring_ends(arr: np.ndarray, tok, prompt_len: int, window: int = 64) -> np.ndarray:
    """Positions just past the token that closes a function's docstring (the second triple-quote token since
    the last `def`, at most `window` tokens after it, followed by a newline): window ends shaped like a
    HumanEval prompt."""
    pieces = [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(list(range(len(tok))))]
    quotes = ('"' * 3, "'" * 3)
    closes = np.array([any(q in x for q in quotes) for x in pieces])[arr]
    newline = np.array(["\n" in x for x in pieces])[arr]
    defs = np.array(["def" in x for x in pieces])[arr]
    idx = np.arange(len(arr))
    last_def = np.maximum.accumulate(np.where(defs, idx, -1))
    quotes_since = np.cumsum(closes) - np.cumsum(closes)[np.maximum(last_def, 0)]  # after the def token
    is_close = closes & (last_def >= 0) & (idx - last_def <= window) & (quotes_since == 2)
    is_close[:-1] &= newline[:-1] | newline[1:]  # a newline follows, in the same token or the next one
    ends = np.nonzero(is_close[:-1])[0] + 1
    ends = ends + (newline[ends] & ~newline[ends - 1])  # the window end takes that newline along
    return ends[(ends >= prompt_len) & (ends < len(arr))]


def loop_start(ids: list[int], n: int = 8) -> int:
    """Index where the first repeated n-gram of `ids` starts its second occurrence (len(ids) if none)."""
    seen = set()
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        if gram in seen:
            return i
        seen.add(gram)
    return len(ids)


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with a static cache (a growing DynamicCache copies itself every step)."""
    length = prompts.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=length + new_tokens)
    dev = prompts.device
    logits = model(input_ids=prompts, cache=cache, use_cache=True,
                   cache_position=torch.arange(length, device=dev)).logits[:, -1]
    out = []
    for i in range(new_tokens):
        logits[:, model.config.mask_token_id] = float("-inf")
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(input_ids=nxt, cache=cache, use_cache=True,
                       cache_position=torch.tensor([length + i], device=dev)).logits[:, -1]
    return torch.cat(out, dim=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", type=Path, default=Path("recguide_hf/bundled/recguide-tiny"))
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--out", type=Path, default=Path("data/distill/teacher.npz"))
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for generation")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--code-share", type=float, default=0.67)
    p.add_argument("--docstring-share", type=float, default=0.0,
                   help="share of code prompts that end where a function's docstring closes")
    p.add_argument("--keep-loops", action=argparse.BooleanOptionalAction, default=True,
                   help="keep looping continuations (for a separate drafting adapter or draft model)")
    p.add_argument("--min-distinct", type=float, default=0.6)
    p.add_argument("--min-kept", type=int, default=16, help="drop continuations shorter than this after the cut")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cuda: generate on a GPU (use a large --batch-size there)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.teacher)
    device = torch.device(args.device)
    model = RecGuideForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).to(device).eval()
    train = load_tokens(args.corpus, tok, "train")
    rng = np.random.default_rng(args.seed)
    newline_ids = {i for t, i in tok.get_vocab().items() if tok.convert_tokens_to_string([t]).strip() == ""}
    doc_ends = docstring_ends(train["code"], tok, args.prompt_len) if args.docstring_share > 0 else None
    if doc_ends is not None:
        print(f"{len(doc_ends)} docstring-closing window ends in the code training split", flush=True)
    kept, valid, dropped = [], [], {"loop": 0, "blank": 0, "short": 0}
    total = 0
    t0 = time.time()
    bar = tqdm(total=int(args.minutes * 60), unit="s", desc="teacher", mininterval=5)
    while time.time() - t0 < args.minutes * 60:
        rows = []
        for _ in range(args.batch_size):
            code = rng.random() < args.code_share
            arr = train["code" if code else "prose"]
            if code and doc_ends is not None and rng.random() < args.docstring_share:
                s = int(doc_ends[rng.integers(0, len(doc_ends))]) - args.prompt_len
            else:
                s = rng.integers(0, len(arr) - args.prompt_len)
            rows.append(arr[s:s + args.prompt_len])
        prompts = torch.from_numpy(np.stack(rows).astype(np.int64))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            cont = greedy(model, prompts.to(device), args.new_tokens).cpu()
        for prompt, c in zip(prompts.tolist(), cont.tolist()):
            total += 1
            if tok.eos_token_id in c:
                c = c[:c.index(tok.eos_token_id) + 1]
            if not args.keep_loops:
                c = c[:loop_start(c)]
                if len(c) < args.min_kept or distinct4(c) < args.min_distinct:
                    dropped["loop"] += 1
                    continue
                if sum(t in newline_ids for t in c) > 0.5 * len(c):
                    dropped["blank"] += 1
                    continue
            if len(c) < 2:
                dropped["short"] += 1
                continue
            row = prompt + c + [tok.pad_token_id] * (args.new_tokens - len(c))
            kept.append(row)
            valid.append(args.prompt_len + len(c))
        bar.update(int(time.time() - t0) - bar.n)
        bar.set_postfix(kept=len(kept), seen=total)
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, tokens=np.asarray(kept, dtype=np.int32), valid=np.asarray(valid, dtype=np.int32),
             prompt_len=args.prompt_len)
    info = {"teacher": str(args.teacher), "seen": total, "kept": len(kept), "dropped": dropped,
            "kept_tokens": int(sum(v - args.prompt_len for v in valid)), "seconds": round(time.time() - t0, 1),
            "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.with_suffix(".json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
