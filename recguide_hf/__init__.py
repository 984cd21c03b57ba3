"""recguide-hf: RecGuide self-speculative decoding for Hugging Face transformers.

The public names are imported on first use, so `import recguide_hf` (and the `recguide` command line, which
checks its arguments before anything else) does not pay for torch and transformers up front. The model classes
register themselves with `AutoConfig` / `AutoModelForCausalLM` when `recguide_hf.models.modeling` is first imported
(any use of `RecGuideForCausalLM`, or loading a model folder with `trust_remote_code=True`). Exported model folders
import only these public names, never a module path.

The package's layers, each importing only from the ones before it (tests/test_layers.py checks):
core (decoding maths and the engine; no transformers) < models (the forward layer over transformers models) <
integrations (HF generate, assisted generation, lm-eval) < serving (the OpenAI-compatible server) < tools (the
`recguide` command line, benchmarks, the profiler). CONTRIBUTING.md maps every module.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

__version__ = "0.1.0"

# the model this package ships (a Hub-style folder: load it with trust_remote_code=True)
BUNDLED_MODEL = Path(__file__).resolve().parent / "bundled" / "recguide-tiny"

_EXPORTS = {"DecodingConfig": "core.config", "RecGuideConfig": "models.modeling",
            "RecGuideForCausalLM": "models.modeling", "RecGuideLlamaForCausalLM": "models.modeling",
            "RecGuideQwen2ForCausalLM": "models.modeling", "RecGuideQwen3ForCausalLM": "models.modeling",
            "RecGuideMistralForCausalLM": "models.modeling", "RecGuideGenerateOutput": "integrations.generate",
            "generate": "integrations.generate", "fetch": "models.known"}
__all__ = [*_EXPORTS, "BUNDLED_MODEL", "__version__"]


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _EXPORTS:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        setattr(self, name, value)
        return value


sys.modules[__name__].__class__ = _Package
