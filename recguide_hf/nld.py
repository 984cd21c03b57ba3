"""Adapter for Nemotron-Labs-Diffusion (NLD) style models (DESIGN 4).

Layout: `model.encoder` (a Ministral3 decoder) + `model.diffusion_head` (Linear to the vocabulary); logits
are `diffusion_head(encoder(...).last_hidden_state)`. NLD switches attention modes with a per-layer flag
`layer.self_attn.diffusion_lm`; here every flag stays False and both modes come from the explicit 4D mask
the engine passes, so one forward can mix verifier (causal) and draft (bidirectional block) tokens.

NLD-8B drafts with a PEFT LoRA adapter (on `o_proj`); `Backbone.forward` routes it per token
(recguide_hf/draft_adapter.py), so verifier tokens get exactly the base weights' output.
"""

from __future__ import annotations

import inspect

import torch

from .backbone import Backbone
from .cache import RowCache
from .draft_adapter import find_adapter


def is_nld_model(model) -> bool:
    return hasattr(model, "encoder") and hasattr(model, "diffusion_head")


class NLDBackbone(Backbone):
    """The engine's interface to an NLD-style model (or a PEFT `PeftModel` wrapping one).

    Args:
        model: the NLD model; a `PeftModel` is unwrapped (its LoRA layers live in the wrapped model).
        mask_token_id: defaults to the model's / its config's `mask_token_id` (100 for NLD).
    """

    unmasked_steps = False  # NLD's remote attention code is only known to run with an explicit mask
    row_runs = False  # nor known to call transformers' attention interface: subsets gather their rows

    def __init__(self, model, mask_token_id: int | None = None):
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        self.model = model
        self.encoder, self.head = model.encoder, model.diffusion_head
        cfg = model.config
        if mask_token_id is None:
            mask_token_id = getattr(model, "mask_token_id", None)
        if mask_token_id is None:
            mask_token_id = getattr(cfg, "mask_token_id", None)
        if mask_token_id is None:
            raise ValueError("The NLD model has no `mask_token_id`; pass mask_token_id= to use it for drafting")
        self.mask_token_id = int(mask_token_id)
        if getattr(cfg, "dlm_type", "llada") == "dream":
            raise NotImplementedError("dlm_type='dream' (draft logits shifted by one) is not supported; RecGuide's "
                                      "branches need the logits at a MASK to predict the token at that position")
        impl = getattr(self.encoder.config, "_attn_implementation", None) or ""
        if impl.startswith("flash"):
            raise ValueError(f"attn_implementation={impl!r} ignores 4D attention masks; load the model with "
                             "attn_implementation='sdpa' (or 'eager')")
        flex = [type(layer.self_attn).__name__ for layer in self.encoder.layers
                if hasattr(layer.self_attn, "set_attention_mode")]
        if flex:
            raise NotImplementedError(f"The encoder's attention class ({flex[0]}) builds its own block masks and "
                                      "would ignore the engine's 4D mask; load the checkpoint so that it uses the "
                                      "standard attention class (NLD: dlm_paradigm='bidirectional', "
                                      "enable_self_spec=False)")
        params = inspect.signature(self.encoder.forward).parameters
        # transformers 5.24 names the cache `cache`; older remote code only knows `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.adapter, self.lora_layers = find_adapter(model)
        self._keep_flags_causal()

    # ------------------------------------------------------------------ facts
    @property
    def device(self) -> torch.device:
        return self.encoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.embed_tokens.weight.dtype

    @property
    def max_positions(self) -> int | None:
        return getattr(self.encoder.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return self.head.out_features

    def new_cache(self, num_rows: int, capacity: int) -> RowCache:
        devices = {p.device for p in self.encoder.parameters()}
        if len(devices) > 1:
            raise NotImplementedError(f"The encoder is spread over several devices ({sorted(map(str, devices))}); "
                                      "the row cache keeps every layer on one device. Load the model on one device "
                                      "(e.g. device_map={'': 0})")
        return RowCache.for_model(self.encoder, num_rows, capacity)

    # ------------------------------------------------------------------ the forward
    def _forward(self, input_ids, position_ids, attention_mask, cache, logits_to_keep):
        self._keep_flags_causal()
        out = self.encoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                           use_cache=True, **{self._cache_kw: cache})
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.head(hidden)

    def _keep_flags_causal(self):
        """NLD's own methods flip these switches; the fused path needs them off (the mask decides)."""
        for layer in self.encoder.layers:
            if getattr(layer.self_attn, "diffusion_lm", False):
                layer.self_attn.diffusion_lm = False
        if getattr(self.encoder.config, "self_spec_inference_mode", None) is not None:
            self.encoder.config.self_spec_inference_mode = None
