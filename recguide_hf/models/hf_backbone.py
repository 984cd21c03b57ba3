"""The engine's backbone (`core.backbone.Backbone`) over a transformers causal LM.

One forward over token ids with a 4D additive mask, per-token position ids and a `RowCache`; a model with a
drafting adapter (a PEFT LoRA, as NLD-8B and this project's bundled model ship) gets its LoRA applied to exactly
the draft tokens (`draft_adapter.route`). Model families that differ subclass it (`nld.NLDBackbone`).
"""

from __future__ import annotations

import torch

from ..core.backbone import Backbone
from .attention import ROW_RUNS
from .cache import RowCache
from .compat import CACHE_KW
from .draft_adapter import find_adapter, route
from .placement import agree_max, device_map_of, input_device, tp_group


class HFBackbone(Backbone):
    """Adapter for any HF causal LM trained for block drafting with a mask token (this project's model,
    SDAR / Fast-dLLM v2 style Qwen checkpoints): both modes are just different masks.

    A forward reaches the model's layers through three side channels besides its arguments, each set for the
    forward's duration only and restored after; none can be an argument without costing speed:
    * the runs of cache rows attention reads in place (`cache.use` -> `attention.set_runs`, a module global):
      passed as data, a compiled graph would be guarded on them and recompile for every new layout of rows;
    * which attention function the layers call (`config._attn_implementation_internal`, flipped to
      `attention.ROW_RUNS`): transformers picks the function from the config, per layer, at call time;
    * the drafting adapter's deltas (`draft_adapter.route`: an instance-level `forward` on each adapted Linear, or
      hooks for a bool mask): a per-token LoRA through PEFT's own forward runs on every token and costs more.
    """

    unmasked_steps = True
    row_runs = True  # the model's attention goes through transformers' attention interface (attention.py)

    def __init__(self, model, mask_token_id: int | None = None):
        if hasattr(model, "get_base_model"):  # peft.PeftModel: its LoRA layers live in the wrapped model
            model = model.get_base_model()
        self.model = model
        cfg = model.config
        self.mask_token_id = mask_token_id if mask_token_id is not None else getattr(cfg, "mask_token_id", None)
        if self.mask_token_id is None:
            raise ValueError("The model's config has no `mask_token_id`; pass mask_token_id= to use it for drafting")
        self.adapter, self.lora_layers = find_adapter(model)
        self._placed(model)

    def _placed(self, model):
        """Where the model runs, past one device: its tensor-parallel group and `spread` (placement.py)."""
        self.tp_group = tp_group(model)
        placed = device_map_of(model)
        if self.tp_group is not None:
            self.spread = f"tensor-parallel over {self.tp_group.size()} ranks"
        elif placed is not None:
            self.spread = f"placed by a device map over {sorted({str(d) for d in placed.values()})}"

    @property
    def device(self) -> torch.device:
        """Where the model takes its inputs (a model placed by accelerate: where its embeddings run)."""
        return input_device(self.model)

    def agree(self, values: list[float]) -> list[float]:
        return values if self.tp_group is None else agree_max(values, self.tp_group, self.device)

    def new_cache(self, num_rows: int, capacity: int) -> RowCache:
        """A per-row-length KV cache; each layer's buffers are made where the layer runs, at its head count."""
        cache = RowCache.for_model(self.model, num_rows, capacity, self.device)
        cache.row_runs = self.row_runs and self._sdpa_everywhere()
        return cache

    def _sdpa_everywhere(self) -> bool:
        """Whether every attention layer reads the model's own config and it says SDPA: then switching that one
        config to `attention.ROW_RUNS` for a forward switches every layer (a layer on a sub-config would not be)."""
        config = self.model.config
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return False
        layers = [m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")]
        return bool(layers) and all(m.config is config for m in layers)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache, draft_mask: torch.Tensor | int | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """See `core.backbone.Backbone.forward`."""
        config = self.model.config
        in_place = getattr(cache, "row_runs", False)
        if in_place:  # the cache's rows are read in place, in runs (attention.py); the internal field: no
            config._attn_implementation_internal = ROW_RUNS  # propagation to sub-configs, no checks
        try:
            with route(self.adapter, draft_mask, self.lora_layers):
                return self._forward(input_ids, position_ids, attention_mask, cache, logits_to_keep)
        finally:
            if in_place:
                config._attn_implementation_internal = "sdpa"  # `new_cache` enabled runs only for SDPA

    def _forward(self, input_ids, position_ids, attention_mask, cache, logits_to_keep):
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, logits_to_keep=logits_to_keep, **{CACHE_KW: cache})
        return out.logits

