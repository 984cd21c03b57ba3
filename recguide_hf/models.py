"""Which backbone adapter drives a model: the one place that knows every adapter class.

The forward layer is `backbone.Backbone` (any HF causal LM trained for block drafting with a mask token) and its
subclasses (`nld.NLDBackbone`); the engine, the profiler and the bench talk only to a `Backbone` this picks.
"""

from __future__ import annotations

from .backbone import Backbone
from .nld import NLDBackbone, is_nld_model


def as_backbone(model) -> Backbone:
    """Pick the adapter for a model (an already wrapped backbone is returned as is)."""
    if isinstance(model, Backbone):
        return model
    if is_nld_model(model):
        return NLDBackbone(model)
    return Backbone(model)
