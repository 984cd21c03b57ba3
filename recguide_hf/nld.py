"""Adapter for Nemotron-Labs-Diffusion style models (filled in by the NLD issue)."""


def is_nld_model(model) -> bool:
    return hasattr(model, "encoder") and hasattr(model, "diffusion_head")


class NLDBackbone:  # pragma: no cover - placeholder until the NLD adapter lands
    def __init__(self, model):
        raise NotImplementedError("NLD-style models are not supported yet")
