"""What differs between the transformers versions this package supports (pyproject.toml states the range).

* The cache keyword: transformers 5.24 renamed `past_key_values` to `cache` (the old name still works there, with
  a deprecation warning); before 5.24 a `cache=` keyword is silently swallowed by `**kwargs` and the forward runs
  without its cache. `CACHE_KW` is the name this installed version's own models take.
"""

from __future__ import annotations

import inspect

from transformers import Qwen3ForCausalLM

CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"
