"""`model.generate` for this folder (loaded with trust_remote_code=True): RecGuide decoding.

All `recguide_*` settings (see generation_config.json) can be passed per call; recguide_mode='ar'
gives plain Hugging Face generation."""

from recguide_hf import generate  # noqa: F401
