"""Write a Hub model folder that loads offline with `trust_remote_code=True`.

The folder's code files are short shims importing the installed `recguide_hf` package (listed in
`custom_generate/requirements.txt`), so the package stays the one source of truth; a test checks the
folder's classes and generate function are the package's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from transformers import GenerationConfig

SHIMS = {
    "configuration_recguide.py": (
        '"""Remote-code shim: the config class lives in the installed `recguide_hf` package."""\n\n'
        "from recguide_hf import RecGuideConfig  # noqa: F401\n"
    ),
    "modeling_recguide.py": (
        '"""Remote-code shim: the model class lives in the installed `recguide_hf` package."""\n\n'
        "from recguide_hf import RecGuideConfig, RecGuideForCausalLM  # noqa: F401\n"
    ),
    "custom_generate/generate.py": (
        '"""`model.generate` for this folder (loaded with trust_remote_code=True): RecGuide decoding.\n\n'
        "All `recguide_*` settings (see generation_config.json) can be passed per call; recguide_mode='ar'\n"
        'gives plain Hugging Face generation."""\n\n'
        "from recguide_hf import generate  # noqa: F401\n"
    ),
    "custom_generate/requirements.txt": "recguide-hf\npeft\n",
}

AUTO_MAP = {
    "AutoConfig": "configuration_recguide.RecGuideConfig",
    "AutoModelForCausalLM": "modeling_recguide.RecGuideForCausalLM",
}


def default_generation_config(config, **recguide_settings) -> GenerationConfig:
    """A fresh GenerationConfig (never `_from_model_config`, which would drop the recguide_* keys)."""
    settings = {"recguide_mode": "recguide", "recguide_block_size": getattr(config, "block_size", 16)}
    settings.update(recguide_settings)
    return GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id,
        suppress_tokens=[config.mask_token_id], do_sample=False, **settings,
    )


def write_code_files(directory: Path) -> None:
    for name, text in SHIMS.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def save_model_folder(model, tokenizer, directory: str | Path, **recguide_settings) -> Path:
    """Save weights (safetensors), config with `auto_map`, tokenizer, generation config and code shims."""
    directory = Path(directory)
    model.config.auto_map = dict(AUTO_MAP)
    model.generation_config = default_generation_config(model.config, **recguide_settings)
    # Loading any folder with trust_remote_code registers the PACKAGE's classes for an auto class (the shims
    # import them); save_pretrained would then copy recguide_hf/models/modeling.py into the folder as a twin and point
    # auto_map at it (seen under transformers 5.0). The shims below are the folder's code: no copy.
    model._auto_class = model.config._auto_class = None
    try:
        model.save_pretrained(directory)
    finally:
        del model._auto_class, model.config._auto_class
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_code_files(directory)
    return directory


# what a self-speculative folder holds besides the base's files (`assemble_folder` copies them from `parts`)
PARTS = ("draft_lora", "value_table.json", "cost_table.json", "cost_table_compiled.json", "README.md")
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "tokenizer.model", "vocab.json", "merges.txt", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE",
              "USE_POLICY.md")  # a base's licence files travel with its weights


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin")) or name.endswith(".index.json")


def _shims_for(class_name: str) -> dict[str, str]:
    return {**{k: v for k, v in SHIMS.items() if k.startswith("custom_generate/")},
            "modeling_recguide.py": ('"""Remote-code shim: the model class lives in the installed `recguide_hf` '
                                     f'package."""\n\nfrom recguide_hf import {class_name}  # noqa: F401\n')}


def _place(src: Path, dst: Path, link: bool) -> None:
    """A copy, or with `link` a hard link where the file system allows (a 0.5 GB weight file is not stored twice;
    only for folders this package manages: writing into a linked file would change the base's)."""
    dst.unlink(missing_ok=True)
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def assemble_folder(base: Path, parts: Path | None, out: Path, mask_token_id: int, block_size: int = 16,
                    weights: bool = True, link: bool = False, **recguide_settings) -> Path:
    """A self-speculative Hub folder from a plain causal LM folder (`base`) and what distillation made (`parts`:
    `draft_lora/`, tables, card; see PARTS): the base's weights (unless `weights=False`) and tokenizer, its config
    with `mask_token_id`, `block_size` and an `auto_map` naming this package's class for its family (the config
    class stays the base's), a RecGuide generation config (argmax greedy: the base's own sampling extras, such as a
    repetition penalty, are not carried over), and the remote-code shims. Nothing is loaded: the weights are copied
    (hard-linked with `link`), the config edited as JSON; the tokenizer pads on the left, as batched decoding needs."""
    from .modeling import SELF_SPECULATIVE

    base, out = Path(base), Path(out)
    config = json.loads((base / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in SELF_SPECULATIVE:
        raise NotImplementedError(f"{base}: model type {model_type!r}; supported: {sorted(SELF_SPECULATIVE)}")
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name == "tokenizer_config.json":  # batches of prompts pad on the left, as decoding needs
            tok_config = {**json.loads(f.read_text()), "padding_side": "left"}
            (out / f.name).unlink(missing_ok=True)
            (out / f.name).write_text(json.dumps(tok_config, indent=2) + "\n")
        elif f.name in BASE_FILES or (weights and _is_weights(f.name)):
            _place(f, out / f.name, link)
    cls = SELF_SPECULATIVE[model_type]
    config.update(mask_token_id=mask_token_id, block_size=block_size,
                  auto_map={"AutoModelForCausalLM": f"modeling_recguide.{cls.__name__}"})
    config["architectures"] = [cls.__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    view = SimpleNamespace(**{k: config.get(k) for k in ("eos_token_id", "pad_token_id", "bos_token_id")},
                           mask_token_id=mask_token_id, block_size=block_size)
    if (base / "generation_config.json").exists():  # the base's own stop tokens (an instruct model's end of turn)
        view.eos_token_id = json.loads((base / "generation_config.json").read_text()).get("eos_token_id",
                                                                                         view.eos_token_id)
    for name, text in _shims_for(cls.__name__).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    for name in PARTS if parts is not None else ():
        src = Path(parts) / name
        if src.is_dir():
            shutil.copytree(src, out / name, dirs_exist_ok=True)
        elif src.exists():
            shutil.copy2(src, out / name)
    if (out / "value_table.json").exists() and (out / "cost_table.json").exists():  # the policy has what it reads
        recguide_settings = {"recguide_block_size": "auto", "recguide_cost_table": "cost_table.json",
                             "recguide_value_table": "value_table.json", **recguide_settings}
    default_generation_config(view, **recguide_settings).save_pretrained(out)
    return out
