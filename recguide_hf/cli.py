"""The `recguide` command line: a thin layer over the package.

    recguide generate --prompt "def fib(n):" [--model DIR] [--mode recguide] [--block-size 16] ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "model_cards" / "recguide-tiny"


def load(model_dir: str | Path | None, dtype: str = "auto", device: str = "cpu"):
    """Tokenizer and model from a folder (default: the bundled recguide-tiny), offline, trust_remote_code."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir) if model_dir else BUNDLED_MODEL
    if not path.exists():
        raise SystemExit(f"Model folder {path} not found")
    torch_dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    auto_map = getattr(AutoConfig.from_pretrained(path, trust_remote_code=True), "auto_map", None) or {}
    # NLD-style folders register only AutoModel (encoder + diffusion head, no causal-LM class)
    auto_class = AutoModel if auto_map and "AutoModelForCausalLM" not in auto_map else AutoModelForCausalLM
    model = auto_class.from_pretrained(path, trust_remote_code=True, dtype=torch_dtype)
    return tokenizer, model.to(device).eval()


def cmd_generate(args) -> int:
    import torch

    import recguide_hf

    tokenizer, model = load(args.model, args.dtype, args.device)
    enc = tokenizer([args.prompt], return_tensors="pt").to(args.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, recguide_mode=args.mode,
                  return_dict_in_generate=True)
    if args.block_size:
        kwargs["recguide_block_size"] = args.block_size if args.block_size == "auto" else int(args.block_size)
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = recguide_hf.generate(model, **enc, **kwargs)
    elapsed = time.perf_counter() - start
    sequences = out.sequences if hasattr(out, "sequences") else out
    new = sequences[0, enc["input_ids"].shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    stats = getattr(out, "recguide_stats", None) or {"new_tokens": int(new.numel())}
    stats = {k: v for k, v in stats.items() if k != "per_request"}
    stats["tokens_per_s"] = stats["new_tokens"] / elapsed if elapsed > 0 else 0.0
    if args.json:
        print(json.dumps({"text": text, "seconds": elapsed, **stats}))
        return 0
    print(args.prompt + text)
    print("-" * 40)
    line = f"{stats['new_tokens']} tokens in {elapsed:.2f}s: {stats['tokens_per_s']:.1f} tokens/s"
    if "tpf" in stats:
        line += f", TPF {stats['tpf']:.2f}, tau {stats['tau']:.2f}"
        if stats.get("branch_rounds"):
            h = stats["hits"]
            line += (f"; branch hits: correction_1 {h['correction_1']}, correction_2 {h['correction_2']}, "
                     f"continuation {h['continuation']} (coverage {stats['coverage']:.0%}, "
                     f"{stats['forwards_saved']} forwards saved)")
    print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recguide", description="RecGuide self-speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with the bundled (or another) model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default=None, help="model folder (default: the bundled recguide-tiny)")
    g.add_argument("--mode", default="recguide", choices=["ar", "linear", "recguide"])
    g.add_argument("--block-size", default=None, help='2..64 or "auto" (default: the model\'s generation config)')
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
