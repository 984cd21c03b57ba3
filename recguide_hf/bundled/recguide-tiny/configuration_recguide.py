"""Remote-code shim: the config class lives in the installed `recguide_hf` package."""

from recguide_hf import RecGuideConfig  # noqa: F401
