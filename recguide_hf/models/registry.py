"""Which backbone adapter drives a model: the one place that knows every adapter class.

The engine talks to a `core.backbone.Backbone`; over transformers models that is `hf_backbone.HFBackbone` (any HF
causal LM trained for block drafting with a mask token) or one of its subclasses (`nld.NLDBackbone`).
"""

from __future__ import annotations

from ..core.backbone import Backbone
from .hf_backbone import HFBackbone
from .nld import NLDBackbone, is_nld_model


def as_backbone(model) -> Backbone:
    """Pick the adapter for a model (an already wrapped backbone is returned as is)."""
    if isinstance(model, Backbone):
        return model
    if is_nld_model(model):
        return NLDBackbone(model)
    return HFBackbone(model)
