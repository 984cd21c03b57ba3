"""The one interface the engine uses to talk to a shared-backbone model.

A backbone runs ONE forward over token ids with a 4D additive mask, per-token position ids and a cache, and says
which tokens of that forward are draft tokens (where a drafting adapter applies). It also knows the vocabulary
facts the engine needs. The engine never looks inside the model: the implementations over transformers models
live in `recguide_hf.models` (`hf_backbone.HFBackbone`, `nld.NLDBackbone`; `registry.as_backbone` picks one).
"""

from __future__ import annotations

import torch


class Backbone:
    """What the engine calls. Subclasses set `self.model` (a torch module with a `config`) and
    `self.mask_token_id`, and implement `new_cache` and `forward`.

    `unmasked_steps`: the model accepts `attention_mask=None` with the row cache for a one-token step that sees its
    whole prefix (HF builds the causal mask from the cache, which for one query is no mask).

    `spread`: how the model is split past one device, in words (a device map over several devices, tensor parallel
    ranks), or None on one device: what the engine names when a setting cannot run on such a model."""

    model: torch.nn.Module
    mask_token_id: int
    unmasked_steps = False
    spread: str | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def agree(self, values: list[float]) -> list[float]:
        """The same numbers on every process that runs this model's forwards together (tensor-parallel ranks: each
        value's largest), so that what the engine decides from them is decided alike on every rank; one process:
        `values` as they are."""
        return values

    def new_cache(self, num_rows: int, capacity: int):
        """A KV cache with one committed length per row (`models.cache.RowCache` for transformers models): the
        engine calls its `commit`, `lengths` and `capacity`; forwards write their query tokens after each row's
        committed length."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache, draft_mask: torch.Tensor | int | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits `[R, Q, V]` (or the last `logits_to_keep` positions).

        Args:
            input_ids: [R, Q] token ids.
            position_ids: [R, Q] each token's position.
            attention_mask: [R, 1, Q, KV] additive, or None for a one-token step over unpadded rows of one length
                (`unmasked_steps`).
            cache: the row cache (`new_cache`), bound to this forward's rows.
            draft_mask: which tokens are computed in draft mode (the drafting adapter, if any, applies exactly
                there): None: none; an int k: columns k.. of every row (0: every token, a draft forward); a
                [R, Q] bool tensor: exactly its True places. Never a Python bool (`True == 1`). The attention
                mode itself comes from the mask.
        """
        raise NotImplementedError
