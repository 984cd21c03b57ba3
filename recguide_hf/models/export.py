"""Write a Hub model folder that loads offline with `trust_remote_code=True`.

The folder's code files are short shims importing the installed `recguide_hf` package (listed in
`custom_generate/requirements.txt`), so the package stays the one source of truth; a test checks the
folder's classes and generate function are the package's.
"""

from __future__ import annotations

from pathlib import Path

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
