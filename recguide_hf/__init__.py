"""recguide-hf: RecGuide self-speculative decoding for Hugging Face transformers.

The public names are imported on first use, so `import recguide_hf` (and the `recguide` command line, which
checks its arguments before anything else) does not pay for torch and transformers up front. The model classes
register themselves with `AutoConfig` / `AutoModelForCausalLM` when `recguide_hf.modeling` is first imported
(any use of `RecGuideForCausalLM`, or loading a model folder with `trust_remote_code=True`).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

__version__ = "0.1.0"

# the model this package ships (a Hub-style folder: load it with trust_remote_code=True)
BUNDLED_MODEL = Path(__file__).resolve().parent / "bundled" / "recguide-tiny"

_EXPORTS = {"DecodingConfig": "config", "RecGuideConfig": "modeling", "RecGuideForCausalLM": "modeling",
            "RecGuideGenerateOutput": "generate", "generate": "generate"}
__all__ = [*_EXPORTS, "BUNDLED_MODEL", "__version__"]


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _EXPORTS:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name, value):
        # importing the submodule `recguide_hf.generate` binds it as this attribute; the name is the function's
        if name == "generate" and isinstance(value, types.ModuleType):
            value = value.generate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
