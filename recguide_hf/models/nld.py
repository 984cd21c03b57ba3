"""Adapter for Nemotron-Labs-Diffusion (NLD) style models (docs/algorithm.md §4).

Layout: `model.encoder` (a Ministral3 decoder) + `model.diffusion_head` (Linear to the vocabulary); logits
are `diffusion_head(encoder(...).last_hidden_state)`. NLD switches attention modes with a per-layer flag
`layer.self_attn.diffusion_lm`; here every flag stays False and both modes come from the explicit 4D mask
the engine passes, so one forward can mix verifier (causal) and draft (bidirectional block) tokens.

NLD-8B drafts with a PEFT LoRA adapter (on `o_proj`); `HFBackbone.forward` routes it per token
(recguide_hf/models/draft_adapter.py), so verifier tokens get exactly the base weights' output.

How NLD's published encoder must be called (issue 30; `recguide_hf/testing/nld_standin_modeling.py` behaves the same
way):

* an explicit mask reaches attention only with `use_causal_mask=True` (NLD's own `linear_spec_generate` and
  axolotl's integration pass it whenever they give a mask); without it the engine's mask is dropped;
* the llama-4 query scale is read from `cache_position`, which the encoder otherwise derives from the cache's
  longest row: the adapter passes each token's own position (1-D when every row has the same positions, else
  `[R, 1, Q]`, which the scale's trailing-axis broadcast turns into one scale per row and token);
* the encoder builds its mask with transformers' `create_causal_mask` under transformers 5.0's keyword names,
  which 5.9 renamed or removed (a TypeError from then on); for a 4D mask that function returns the mask as given,
  so the adapter wraps the encoder module's mask builders once (`bridge_mask_builders`) to do exactly that and
  to pass anything else on unchanged: NLD's files then run under every transformers version this package
  supports, and NLD's own methods (which pass no 4D mask) see the builders they had.
"""

from __future__ import annotations

import inspect
import sys

import torch

from .cache import RowCache
from .draft_adapter import find_adapter
from .hf_backbone import HFBackbone
from .placement import input_device


def bridge_mask_builders(module) -> None:
    """Make `module`'s `create_causal_mask` / `create_sliding_window_causal_mask` return a 4D mask as given
    (transformers 5.0's early exit, under any keyword names) and call the original for anything else. Done once
    per module (idempotent), so concurrent forwards never see a half-swapped function."""
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        original = getattr(module, name, None)
        if not callable(original) or getattr(original, "_recguide_bridge", False):
            continue

        def build(*args, _original=original, **kwargs):
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 4:
                return mask
            return _original(*args, **kwargs)

        build._recguide_bridge = True
        setattr(module, name, build)


def nld_tp_plan() -> dict[str, str]:
    """The tensor-parallel plan of an NLD model (`from_pretrained(..., tp_plan=nld_tp_plan())` under `torchrun`):
    its encoder's decoder layers as transformers shards Ministral3's (attention heads and MLP columns split, the
    second projection of each summed across ranks); the embeddings and `diffusion_head` stay whole on every rank,
    so the logits every rank reads are the same numbers. The drafting LoRA on `o_proj` is sliced with the layer
    (`placement.local_lora`)."""
    plan = {}
    for name, style in (("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
                        ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
                        ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise")):
        plan[f"encoder.layers.*.{name}"] = style
    return plan


def is_nld_model(model) -> bool:
    return hasattr(model, "encoder") and hasattr(model, "diffusion_head")


class NLDBackbone(HFBackbone):
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
        paradigm = getattr(cfg, "dlm_paradigm", None) or getattr(self.encoder.config, "dlm_paradigm", None)
        flex = [type(layer.self_attn).__name__ for layer in self.encoder.layers
                if "flex" in type(layer.self_attn).__name__.lower() or hasattr(layer.self_attn, "set_attention_mode")]
        if flex or paradigm == "block_diff":
            what = f"attention class {flex[0]}" if flex else "dlm_paradigm='block_diff'"
            raise NotImplementedError(f"The encoder's {what} builds its own block masks (flex attention) and never "
                                      "reads the engine's 4D mask; load the checkpoint with its standard attention "
                                      "class (NLD: dlm_paradigm='bidirectional', the published default)")
        params = inspect.signature(self.encoder.forward).parameters
        # transformers 5.24 names the cache `cache`; NLD's files (written for 5.0) only know `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._gate_kw = "use_causal_mask" in params  # NLD: a mask counts only with use_causal_mask=True
        self._takes_cache_position = "cache_position" in params
        bridge_mask_builders(sys.modules.get(type(self.encoder).__module__))
        rope = getattr(self.encoder.config, "rope_parameters", None) or getattr(self.encoder.config, "rope_scaling",
                                                                                None) or {}
        # the llama-4 query scale: 1 below this position, position-dependent from it on (None: not scaled)
        self._llama4_from = rope.get("original_max_position_embeddings") if rope.get("llama_4_scaling_beta") else None
        self.adapter, self.lora_layers = find_adapter(model)
        self._placed(model)
        self._keep_flags_causal()

    # ------------------------------------------------------------------ facts
    @property
    def device(self) -> torch.device:
        return input_device(self.model)  # the encoder's embeddings (`get_input_embeddings`), or the hook above them

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
        """A per-row-length KV cache; each layer's buffers are made where the layer runs, at its head count."""
        return RowCache.for_model(self.encoder, num_rows, capacity, self.device)

    # ------------------------------------------------------------------ the forward
    def _forward(self, input_ids, position_ids, attention_mask, cache, logits_to_keep):
        self._keep_flags_causal()
        kwargs = {self._cache_kw: cache}
        if self._gate_kw and attention_mask is not None:
            kwargs["use_causal_mask"] = True
        if self._takes_cache_position:
            kwargs["cache_position"] = self._cache_position(position_ids)
        out = self.encoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                           use_cache=True, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        # where the inputs came from: a device map may put the head on another device, and the encoder and head are
        # called here one by one, past the hook that brings a placed model's outputs back (no copy on one device)
        return self.head(hidden).to(input_ids.device)

    def _cache_position(self, position_ids: torch.Tensor) -> torch.Tensor:
        """What NLD's attention reads per token: the token's position (slot = position in the row cache).

        Args:
            position_ids: [R, Q].
        Returns [Q] when every row has the same positions, or when no query crosses the llama-4 threshold
        (every scale is then 1, whatever the positions); else [R, 1, Q], one scale per row and token."""
        first = position_ids[0]
        if position_ids.shape[0] == 1 or self._llama4_from is None:
            return first
        if int(position_ids.max()) < self._llama4_from or bool((position_ids == first).all()):
            return first
        return position_ids[:, None, :]

    def _keep_flags_causal(self):
        """NLD's own methods flip these switches; the fused path needs them off (the mask decides)."""
        for layer in self.encoder.layers:
            if getattr(layer.self_attn, "diffusion_lm", False):
                layer.self_attn.diffusion_lm = False
        if getattr(self.encoder.config, "self_spec_inference_mode", None) is not None:
            self.encoder.config.self_spec_inference_mode = None
