"""The self-speculative model classes: one backbone, two attention modes.

`RecGuideForCausalLM` is the bundled model's (Qwen3-style, its own config type `recguide`); `SelfSpeculative` makes
any family's causal-LM class self-speculative, and `recguide distill` names one of the classes built with it
(`RecGuideLlamaForCausalLM`, ...) in the folders it exports, whose configs stay the family's own.

Which mode a token is computed in is decided only by the 4D additive attention mask and the per-token
position ids the caller passes:

* causal (AR) mode: the usual lower-triangular mask; logits at position i predict token i + 1;
* block-diffusion (draft) mode: a block of MASK tokens attends to the cached prefix and bidirectionally
  to itself; the logits at a MASK position predict the token AT that position (NLD / SDAR convention).

The class adds nothing to the forward of `Qwen3ForCausalLM` (both `cache` and the pre-5.24 name
`past_key_values` are accepted, on every supported transformers version; `logits_to_keep` is honoured, and any
`Cache` subclass works since attention only calls `cache.update`); it carries `mask_token_id` and a default
block size in its config.
A folder may carry a drafting adapter in `draft_lora/` (recguide_hf/models/draft_adapter.py): `from_pretrained`
attaches it, disabled for plain forwards, so only the engine's draft tokens ever see it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import cached_file

from ..core.masks import additive_mask
from .compat import CACHE_KW
from .draft_adapter import ADAPTER_DIR, attach_draft_adapter


class RecGuideConfig(Qwen3Config):
    """`Qwen3Config` plus the two facts a self-speculative decoder needs.

    Args:
        mask_token_id: id of the MASK token fed at positions to be drafted.
        block_size: default draft block size B (seed + B - 1 drafted tokens).
    """

    model_type = "recguide"

    def __init__(self, mask_token_id: int | None = None, block_size: int = 16, **kwargs):
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        super().__init__(**kwargs)


class SelfSpeculative:
    """What makes a transformers causal LM class self-speculative: `from_pretrained` attaches the folder's drafting
    adapter (`draft_lora/`), disabled for plain forwards; on transformers < 5.24 `forward` takes `cache` too. The
    forward is the base class's: a MASK token id in the config and a drafting adapter are all the engine needs."""

    if CACHE_KW == "past_key_values":  # transformers < 5.24: take the new name too, so every caller may use it
        def forward(self, *args, cache=None, **kwargs):
            if cache is not None:
                kwargs["past_key_values"] = cache
            return super().forward(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, draft_adapter: bool = True, **kwargs):
        """`PreTrainedModel.from_pretrained`, then the folder's `draft_lora/` adapter if it has one.

        Args:
            draft_adapter: attach the folder's drafting adapter (False: the verifier alone, e.g. to train one).
        """
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if draft_adapter:
            hub = {k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token") if k in kwargs}
            found = cached_file(str(pretrained_model_name_or_path), f"{ADAPTER_DIR}/adapter_config.json",
                                _raise_exceptions_for_missing_entries=False, **hub)
            if found:
                cached_file(str(pretrained_model_name_or_path), f"{ADAPTER_DIR}/adapter_model.safetensors", **hub)
                attach_draft_adapter(model, Path(found).parent)
        return model


class RecGuideForCausalLM(SelfSpeculative, Qwen3ForCausalLM):
    """A Qwen3 decoder trained for both next-token prediction and block drafting."""

    config_class = RecGuideConfig

    @torch.no_grad()
    def draft_logits(self, seed_ids: torch.Tensor, cache, prefix_len: int, block_size: int | None = None,
                     keep_cache: bool = True) -> torch.Tensor:
        """Block-diffusion forward over `[seed, MASK x (B-1)]` after a cached prefix of `prefix_len` tokens.

        Args:
            seed_ids: [R] the last committed-to-be token of each row (not yet in the cache).
            cache: an HF cache holding the prefix (rows share `prefix_len`, no padding).
            keep_cache: if True the cache is left as it was (a DynamicCache is cropped back).
        Returns:
            logits [R, B, V]; position j >= 1 predicts the token AT position prefix_len + j.
        """
        block = block_size or self.config.block_size
        num_rows = seed_ids.shape[0]
        ids = torch.full((num_rows, block), self.config.mask_token_id, dtype=torch.long, device=seed_ids.device)
        ids[:, 0] = seed_ids
        pos = torch.arange(prefix_len, prefix_len + block, device=seed_ids.device).expand(num_rows, -1)
        mask = block_draft_mask(prefix_len, block, device=seed_ids.device).expand(num_rows, -1, -1, -1)
        logits = self(input_ids=ids, position_ids=pos, attention_mask=mask.to(self.dtype), cache=cache,
                      use_cache=True).logits
        if keep_cache and hasattr(cache, "crop") and cache.get_seq_length() == prefix_len + block:
            cache.crop(-block)
        return logits


def block_draft_mask(prefix_len: int, block_size: int, device=None) -> torch.Tensor:
    """Additive mask `[1, 1, B, prefix_len + B]` for one draft block after a cached prefix.

    Every block token sees the whole prefix and every other block token (bidirectional).
    """
    allowed = torch.ones(1, 1, block_size, prefix_len + block_size, dtype=torch.bool, device=device)
    return additive_mask(allowed)


class RecGuideLlamaForCausalLM(SelfSpeculative, LlamaForCausalLM):
    """A Llama-family model (SmolLM2, Llama 3) made self-speculative by `recguide distill` (config: `llama`, plus
    `mask_token_id` and `block_size`)."""

    config_class = LlamaConfig


class RecGuideQwen2ForCausalLM(SelfSpeculative, Qwen2ForCausalLM):
    """A Qwen2-family model made self-speculative by `recguide distill`."""

    config_class = Qwen2Config


class RecGuideQwen3ForCausalLM(SelfSpeculative, Qwen3ForCausalLM):
    """A Qwen3 model made self-speculative by `recguide distill` (its config stays `qwen3`)."""

    config_class = Qwen3Config


class RecGuideMistralForCausalLM(SelfSpeculative, MistralForCausalLM):
    """A Mistral-family model made self-speculative by `recguide distill`."""

    config_class = MistralConfig


# model_type -> the self-speculative class an exported folder's remote code names (`export.assemble_folder`)
SELF_SPECULATIVE = {"llama": RecGuideLlamaForCausalLM, "qwen2": RecGuideQwen2ForCausalLM,
                    "qwen3": RecGuideQwen3ForCausalLM, "mistral": RecGuideMistralForCausalLM}


AutoConfig.register("recguide", RecGuideConfig, exist_ok=True)
AutoModelForCausalLM.register(RecGuideConfig, RecGuideForCausalLM, exist_ok=True)
