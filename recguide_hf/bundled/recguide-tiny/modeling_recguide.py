"""Remote-code shim: the model class lives in the installed `recguide_hf` package."""

from recguide_hf import RecGuideConfig, RecGuideForCausalLM  # noqa: F401
