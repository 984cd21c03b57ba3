"""The drafting adapter: a LoRA that only draft tokens see (NLD-8B's layout, for every backbone).

A self-speculative model may draft with extra low-rank weights on top of the shared backbone (NLD-8B: a PEFT
LoRA on `o_proj`; this project's bundled model: a LoRA on every linear layer). The verifier must never see
them. Routing is per token, so one fused forward can mix verifier and draft tokens:

* every LoRA layer runs with its adapters disabled, so PEFT returns exactly `base_layer(x)`;
* a forward hook adds the LoRA delta back only where the engine's `draft_mask` is True (`torch.where`).

Verifier tokens therefore get bit-for-bit the base weights' output. Outside a routed forward the adapters
stay disabled, so plain `model(...)` / `model.generate(...)` is the verifier alone.

On disk the adapter is a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`, keys as
`PeftModel.save_pretrained` writes them); a model folder carries it as `draft_lora/` beside its weights.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_DIR = "draft_lora"
_PREFIX = "base_model.model."


def lora_layers(module) -> list:
    """PEFT LoRA layers inside `module` (empty without PEFT or without adapters)."""
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


def set_adapters(layers: list, enabled: bool):
    """Switch the LoRA delta on or off for every token (training uses this; decoding routes per token)."""
    for m in layers:
        m._disable_adapters = not enabled


@contextmanager
def route(layers: list, draft_mask: torch.Tensor | bool | None):
    """Adapters off for every token; the LoRA delta added back where `draft_mask` [R, Q] is True.

    `draft_mask=True`: every token is a draft token (a draft forward), so PEFT's own forward applies the LoRA with
    no selection; `None` / `False`: no draft token, the base weights alone.
    """
    if not layers:
        yield
        return
    saved = [m._disable_adapters for m in layers]
    handles = []
    try:
        set_adapters(layers, draft_mask is True)  # off: PEFT's forward is then exactly base_layer(x)
        if isinstance(draft_mask, torch.Tensor):
            select = draft_mask[:, :, None]
            hook = lambda module, args, output: _add_lora(module, args[0], output, select)
            handles = [m.register_forward_hook(hook) for m in layers]
        yield
    finally:
        for h in handles:
            h.remove()
        for m, flag in zip(layers, saved):
            m._disable_adapters = flag


def _add_lora(module, x: torch.Tensor, base: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """PEFT's LoRA sum (same operations as `peft.tuners.lora.Linear.forward`), kept only where `select`.

    The delta is computed for every token and then selected, so finding the draft tokens needs no host sync;
    at LoRA rank << hidden size that costs a small fraction of the base layer.
    """
    adapted = base
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        xa = x.to(lora_a.weight.dtype)
        adapted = adapted + lora_b(lora_a(module.lora_dropout[name](xa))) * module.scaling[name]
    return torch.where(select.to(base.device), adapted.to(base.dtype), base)


def add_draft_adapter(model, rank: int, alpha: float, target_modules: list[str]) -> list:
    """Inject a fresh LoRA (B = 0, so it starts as the identity) into `model` in place; returns its layers,
    disabled. The base weights are frozen, the LoRA weights trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none")
    inject_adapter_in_model(config, model)
    model._draft_lora_config = config
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    layers = lora_layers(model)
    set_adapters(layers, False)
    return layers


def save_draft_adapter(model, directory: str | Path):
    """Write the adapter as a PEFT LoRA folder (loadable by `PeftModel.from_pretrained` too)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model._draft_lora_config
    config.save_pretrained(directory)
    tensors = {_PREFIX + k.replace(".default", ""): v.detach().contiguous().cpu()
               for k, v in model.state_dict().items() if "lora_" in k}
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})


def attach_draft_adapter(model, directory: str | Path) -> list:
    """Inject the LoRA saved in `directory` into `model` (in place, disabled for plain forwards); returns its layers."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = json.loads((directory / "adapter_config.json").read_text())
    targets = cfg["target_modules"]
    layers = add_draft_adapter(model, cfg["r"], cfg["lora_alpha"], sorted(targets) if isinstance(targets, list)
                               else targets)
    weights = load_file(directory / "adapter_model.safetensors")
    own = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    renamed = {}
    for key, value in weights.items():
        name = key.removeprefix(_PREFIX).replace(".weight", ".default.weight")
        if name not in own:
            raise ValueError(f"{directory}: adapter weight {key} matches no module of {type(model).__name__}")
        renamed[name] = value.to(own[name].dtype)
    missing = set(own) - set(renamed)
    if missing:
        raise ValueError(f"{directory}: the adapter lacks {len(missing)} LoRA weights, e.g. {sorted(missing)[0]}")
    model.load_state_dict(renamed, strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return layers
