"""Adapter for Nemotron-Labs-Diffusion (NLD) style models (DESIGN 4).

Layout: `model.encoder` (a Ministral3 decoder) + `model.diffusion_head` (Linear to the vocabulary); logits
are `diffusion_head(encoder(...).last_hidden_state)`. NLD switches attention modes with a per-layer flag
`layer.self_attn.diffusion_lm`; here every flag stays False and both modes come from the explicit 4D mask
the engine passes, so one forward can mix verifier (causal) and draft (bidirectional block) tokens.

NLD-8B drafts with a PEFT LoRA adapter (on `o_proj`) that must be on for drafting and off for
verification. In a fused forward the routing is per token: during our forward every LoRA layer runs with
its adapters disabled (PEFT then returns exactly `base_layer(x)`), and a forward hook adds the LoRA
contribution only at the draft tokens (`torch.where` on the engine's `draft_mask`). Verifier tokens
therefore get bit-for-bit the base layer's output: their logits are exactly those of the model with the
LoRA disabled. Nothing is left changed on the model after a forward (the hooks are removed and the
adapter switches restored).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from .backbone import Backbone
from .cache import RowCache


def is_nld_model(model) -> bool:
    return hasattr(model, "encoder") and hasattr(model, "diffusion_head")


def _lora_linears(module) -> list:
    """PEFT LoRA layers inside `module` (empty without PEFT)."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        if not isinstance(m, LoraLinear):
            raise NotImplementedError(f"Per-token LoRA routing supports LoRA on Linear layers only, found {type(m)}")
        if m.merged:
            raise ValueError("A LoRA adapter is merged into the base weights, so the verifier would run the drafter's "
                             "weights; unmerge it (model.unmerge_adapter()) before decoding")
        variants = [a for a in m.active_adapters if a in getattr(m, "lora_variant", {})]
        if variants:
            raise NotImplementedError(f"LoRA variants (DoRA etc.) are not supported for drafting: {variants}")
    return layers


class NLDBackbone(Backbone):
    """The engine's interface to an NLD-style model (or a PEFT `PeftModel` wrapping one).

    Args:
        model: the NLD model; a `PeftModel` is unwrapped (its LoRA layers live in the wrapped model).
        mask_token_id: defaults to the model's / its config's `mask_token_id` (100 for NLD).
    """

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
        self.lora_layers = _lora_linears(self.encoder)
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
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache, draft_mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits `[R, Q, V]`; the LoRA (if any) applies exactly to the tokens where `draft_mask` [R, Q] is True."""
        self._keep_flags_causal()
        with self._route(draft_mask):
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

    @contextmanager
    def _route(self, draft_mask: torch.Tensor | None):
        """Adapters off for every token; the LoRA delta added back where `draft_mask` is True."""
        if not self.lora_layers:
            yield
            return
        saved = [m._disable_adapters for m in self.lora_layers]
        handles = []
        try:
            for m in self.lora_layers:
                m._disable_adapters = True  # PEFT's forward is then exactly base_layer(x)
            if draft_mask is not None:
                select = draft_mask[:, :, None]
                hook = lambda module, args, output: _add_lora(module, args[0], output, select)  # noqa: E731
                handles = [m.register_forward_hook(hook) for m in self.lora_layers]
            yield
        finally:
            for h in handles:
                h.remove()
            for m, flag in zip(self.lora_layers, saved):
                m._disable_adapters = flag


def _add_lora(module, x: torch.Tensor, base: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """PEFT's LoRA sum (same operations as `peft.tuners.lora.Linear.forward`), kept only where `select`.

    The delta is computed for every token and then selected, so finding the draft tokens needs no host sync;
    at LoRA rank << hidden size (NLD-8B: 128 vs 4096) that costs a few percent of `o_proj`.
    """
    adapted = base
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        xa = x.to(lora_a.weight.dtype)
        adapted = adapted + lora_b(lora_a(module.lora_dropout[name](xa))) * module.scaling[name]
    return torch.where(select.to(base.device), adapted.to(base.dtype), base)
