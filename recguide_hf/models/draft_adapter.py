"""The drafting adapter: a LoRA that only draft tokens see (NLD-8B's layout, for every backbone).

A self-speculative model may draft with extra low-rank weights on top of the shared backbone (NLD-8B: a PEFT
LoRA on `o_proj`; this project's bundled model: a LoRA on every linear layer). The verifier must never see
them. Routing is per token, so one fused forward can mix verifier and draft tokens:
* a forward with some draft tokens (verify + branch segments): for its duration a forward hook on each adapted
  `Linear` adds `scaling * B(A(x))` where the engine's `draft_mask` is True;
* a forward whose tokens are all draft tokens (a draft forward, `draft_mask=0`): each adapted `Linear` runs
  with merged weights `W + scaling * B A` (computed once, kept beside `W`), so drafting costs what a plain
  forward costs (the hooks' extra small matmuls would not). For the forward's duration each such `Linear` gets
  an instance-level `forward` that multiplies by its merged weight; `W` itself is never touched (swapping
  `weight.data` costs more than the override: CHANGELOG.md);
* a forward without draft tokens registers nothing: verifier tokens get bit-for-bit the base weights' output and
  a verify-only forward costs exactly what the base model costs (no wrapper modules stay in the model).

Two sources, one mechanism (`DraftAdapter`):
* a folder's `draft_lora/` (PEFT LoRA format: `adapter_config.json` + `adapter_model.safetensors`, loadable by
  `PeftModel.from_pretrained` too) attached by `attach_draft_adapter` as the model's `draft_adapter` submodule;
* PEFT LoRA layers already injected in a model (NLD + `PeftModel`): their weights are read in place and the PEFT
  layers are kept disabled during our forwards (PEFT's forward is then exactly `base_layer(x)`), restored after.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .placement import all_reduce_sum, execution_device, input_device, is_plain, is_sharded, local_lora

ADAPTER_DIR = "draft_lora"
_PREFIX = "base_model.model."


class DraftAdapter(nn.Module):
    """Low-rank deltas `scaling * B A` for named `Linear` layers of a model, applied by `route` only.

    Args:
        linears: {module name: the model's Linear} to adapt (held by reference, not registered here).
        rank: LoRA rank r.
        alpha: LoRA alpha (scaling = alpha / r, as PEFT's default).
        target_modules: the module names the adapter targets (as PEFT's config lists them).
        device: where a layer's weights go when its own execution device is not known (an offloaded layer loaded by
            a hook above it): the model's execution device.
    """

    def __init__(self, linears: dict[str, nn.Linear], rank: int, alpha: float, target_modules: list[str],
                 device: torch.device | None = None):
        super().__init__()
        self.names = list(linears)
        self._linears = list(linears.values())  # a plain list: the model already owns these modules
        # beside the layer each adapts: where it computes (an offloaded layer's weights sit on `meta`), full size (a
        # tensor-parallel layer's slice of them is taken when routing: `placed_entries`)
        where = [execution_device(m, device) for m in self._linears]
        self.lora_A = nn.ParameterList(nn.Parameter(torch.empty(rank, m.in_features, dtype=m.weight.dtype, device=d))
                                       for m, d in zip(self._linears, where))
        self.lora_B = nn.ParameterList(nn.Parameter(torch.zeros(m.out_features, rank, dtype=m.weight.dtype, device=d))
                                       for m, d in zip(self._linears, where))
        for a in self.lora_A:  # PEFT's default init: A random, B zero, so a fresh adapter changes nothing
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.rank, self.alpha, self.target_modules = rank, alpha, list(target_modules)
        self._merged: list[torch.Tensor] | None = None
        self._merged_forwards: list | None = None
        self._stacked: list | None = None  # route's stacked `A`s per input group (frozen adapters only)
        self._mergeable: bool | None = None  # decided once: where the layers' weights sit is fixed at loading

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def entries(self):
        """(linear, A [r, in], B [out, r], scaling) per adapted layer."""
        return [(m, a, b, self.scaling) for m, a, b in zip(self._linears, self.lora_A, self.lora_B)]

    def merged_weights(self) -> list[torch.Tensor] | None:
        """`W + scaling * B A` per adapted layer for draft forwards; None while the adapter is being trained
        (gradients must reach A and B, so the hooks are used then) or where a layer's `W` is not a plain tensor
        where it runs (a tensor-parallel shard, an offloaded layer's `meta` weight: the hooks add the delta), and on
        a model whose layers sit on several devices (one that did not fit one device has no room for a second copy
        of its adapted weights)."""
        if self._mergeable is None:
            self._mergeable = (all(is_plain(m) for m in self._linears)
                               and len({m.weight.device for m in self._linears}) == 1)
        if not self._mergeable or any(p.requires_grad for p in self.parameters()):
            self._merged = self._merged_forwards = None
            return None
        if self._merged is None or self._merged[0].device != self._linears[0].weight.device:
            with torch.no_grad():
                self._merged = [(m.weight + (b @ a).to(m.weight.dtype) * self.scaling).contiguous()
                                for m, a, b in zip(self._linears, self.lora_A, self.lora_B)]
            self._merged_forwards = None
        return self._merged

    def merged_forwards(self) -> list | None:
        """[(adapted Linear, a forward on its merged weight)] for draft forwards (`route`), made once; None while
        the adapter is being trained."""
        merged = self.merged_weights()
        if merged is None:
            return None
        if self._merged_forwards is None:
            self._merged_forwards = [(m, _linear_on(w, m.bias)) for m, w in zip(self._linears, merged)]
        return self._merged_forwards


def _linear_on(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x):
        return F.linear(x, weight, bias)
    return forward


class PeftLayers:
    """The same view over PEFT LoRA layers injected in a model (NLD's drafting LoRA under a `PeftModel`)."""

    def __init__(self, layers: list):
        self.layers = layers

    def entries(self):
        out = []
        for m in self.layers:
            for name in m.active_adapters:
                if name in m.lora_A:
                    out.append((m.base_layer, m.lora_A[name].weight, m.lora_B[name].weight, m.scaling[name]))
        return out


def placed_entries(adapter) -> list:
    """(linear, A, B, scaling, group) per adapted layer, each as the slice of its layer this process holds needs it
    (`placement.local_lora`; group: the ranks whose `A x` products are summed, None where nothing is). On one device:
    `entries()` as they are, with no group."""
    entries = adapter.entries()
    sharded = getattr(adapter, "_sharded", None)
    if sharded is None:  # decided when the model was loaded: checked once
        sharded = adapter._sharded = any(is_sharded(m) for m, *_ in entries)
    if not sharded:
        return [(*e, None) for e in entries]
    if getattr(adapter, "_local", None) is None:
        if any(a.requires_grad or b.requires_grad for _, a, b, _ in entries):
            raise NotImplementedError("Training a drafting adapter on a tensor-parallel model is not supported")
        local = [(m, local_lora(m, a, b), scaling) for m, a, b, scaling in entries]
        adapter._local = [(m, a, b, scaling, group) for m, (a, b, group), scaling in local]
    return adapter._local


def peft_lora_layers(module) -> list:
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


def find_adapter(model) -> tuple[DraftAdapter | PeftLayers | None, list]:
    """The model's drafting adapter (native `draft_adapter` or PEFT layers) and its PEFT layers (to keep off)."""
    native = getattr(model, "draft_adapter", None)
    layers = peft_lora_layers(model)
    if native is not None and layers:
        raise ValueError("The model has both a `draft_adapter` and PEFT LoRA layers; keep one drafting adapter")
    if native is not None:
        return native, []
    return (PeftLayers(layers) if layers else None), layers


@contextmanager
def route(adapter, draft_mask: torch.Tensor | int | None, peft_layers: list = ()):
    """Apply `adapter`'s deltas to the draft tokens of the forwards run inside this block.

    Args:
        draft_mask: which tokens draft (`core.backbone.Backbone.forward`): None (none: nothing is registered, the
            forward is the base model's), an int k (the tokens from column k on, in every row; 0: every token, a
            draft forward, on merged weights; k > 0: the engine's branch segments after the verifier segment, the
            cheapest mixed form) or a [R, Q] bool tensor (exactly those tokens). A bool is refused: `True == 1`.
        peft_layers: PEFT LoRA layers to keep disabled meanwhile (their delta comes from the hooks instead).
    """
    if isinstance(draft_mask, bool):
        raise TypeError("draft_mask takes None, an int k (columns k.. draft; 0: every token) or a bool tensor, "
                        f"not {draft_mask!r} (True == 1 would read as 'columns 1..')")
    every = isinstance(draft_mask, int) and draft_mask == 0
    saved = [m._disable_adapters for m in peft_layers]
    handles, overridden = [], []
    try:
        for m in peft_layers:
            m._disable_adapters = True  # PEFT's forward is then exactly base_layer(x)
        merged = adapter.merged_forwards() if every and isinstance(adapter, DraftAdapter) else None
        if merged is not None:  # every token drafts: run the adapted layers on merged weights
            for linear, forward in merged:
                overridden.append((linear, linear.__dict__.get("forward")))
                linear.__dict__["forward"] = forward  # what Module.__call__ runs, ahead of the class's forward
        elif isinstance(draft_mask, int) and not every:
            if adapter is not None:  # the tokens from column `draft_mask` on draft: a delta on them alone
                for linear, forward in _suffix_forwards(adapter, draft_mask):
                    overridden.append((linear, linear.__dict__.get("forward")))
                    linear.__dict__["forward"] = forward
        elif adapter is not None and draft_mask is not None:
            select = None if every else draft_mask[:, :, None]
            for linear, a, b, scaling, group in placed_entries(adapter):
                hook = _delta_hook(a, b, scaling, select, group)
                handles.append(linear.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()
        for linear, previous in overridden:
            if previous is None:
                del linear.__dict__["forward"]
            else:
                linear.__dict__["forward"] = previous
        for m, flag in zip(peft_layers, saved):
            m._disable_adapters = flag


# Sibling layers of HF decoder layers that read one and the same input tensor (attention: q/k/v on the normed
# hidden states; MLP: gate/up on the normed hidden states), so their LoRA `A` products can be one product.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def input_groups(names: list[str]) -> list[list[int]]:
    """Indices into `names` (module paths of adapted layers), grouped where siblings read one input (`SHARED_INPUT`:
    same parent module, names in one set); every other layer is a group of its own. Order: first member first."""
    groups, where = [], {}
    for i, name in enumerate(names):
        parent, _, leaf = name.rpartition(".")
        shared = next((tuple(s) for s in SHARED_INPUT if leaf in s), None)
        key = (parent, shared) if shared else None
        if key is not None and key in where:
            groups[where[key]].append(i)
        else:
            if key is not None:
                where[key] = len(groups)
            groups.append([i])
    return groups


class _Shared:
    """One group's `x[:, start:] @ A_cat^T` for the input `x` it was last computed on (held, so `is` is sound)."""
    __slots__ = ("x", "h")

    def __init__(self):
        self.x = self.h = None


def _suffix_forwards(adapter, start: int) -> list:
    """[(adapted Linear, its forward with the delta on columns `start`..)] for `route(adapter, start)`. Layers that
    read one input tensor (`input_groups`) share one `A` product: with `A_cat` = their `A`s stacked, whichever
    member runs first on an input computes `x[:, start:] @ A_cat^T` and the others take their `r` columns of it, as
    long as they are called on that very tensor (checked by identity; otherwise a member computes it anew)."""
    entries = placed_entries(adapter)
    frozen = isinstance(adapter, DraftAdapter) and not any(p.requires_grad for p in adapter.parameters())
    stacked = adapter._stacked if frozen else None  # frozen: stacked once (like the merged weights); training: anew
    if stacked is None or stacked[0][1].device != entries[0][1].device:
        names = getattr(adapter, "names", None)
        groups = (input_groups(names) if names is not None and len(names) == len(entries)
                  else [[i] for i in range(len(entries))])
        stacked = [(group, entries[group[0]][1] if len(group) == 1 else torch.cat([entries[i][1] for i in group]))
                   for group in groups]
        if isinstance(adapter, DraftAdapter):
            adapter._stacked = [(g, a.detach()) for g, a in stacked] if frozen else None
    out = []
    for group, a_cat in stacked:
        shared, offset = _Shared(), 0
        for i in group:  # siblings on one input are sharded alike: the first one's ranks sum the group's product
            linear, a, b, scaling, _ = entries[i]
            out.append((linear, _suffix_forward(linear, a_cat, offset, a.shape[0], b, scaling, start, shared,
                                                entries[group[0]][4])))
            offset += a.shape[0]
    return out


def _suffix_forward(linear: nn.Linear, a_cat: torch.Tensor, offset: int, rank: int, b: torch.Tensor,
                    scaling: float, start: int, shared: _Shared, ranks=None):
    """The linear's forward plus the delta on the tokens from column `start` on only (the engine's branch segments
    sit after the verifier tokens): the small matmuls run on those tokens alone and the verifier tokens' output is
    not touched. `a_cat` rows `offset : offset + rank` are this layer's `A`; the product with them is shared with
    its input group (`_suffix_forwards`); `ranks`: the process group that sums it (a row-wise tensor-parallel layer's
    partial product: `placement.local_lora`). Under no_grad the `B` product is added in place in one op (`addmm_` /
    `baddbmm_` into the output's draft columns) where the dtypes agree.

    An instance-level forward rather than a forward hook: a hooked module's call takes torch's slow path. (Why
    this form, measured against two others: CHANGELOG.md.)"""
    base = linear.forward  # the class's (or PEFT base layer's) own forward, bound, so a Linear subclass keeps its own
    whole = offset == 0 and rank == a_cat.shape[0]
    b_t = b.t()

    def forward(x):
        y = base(x)
        if shared.x is not x:
            shared.x, shared.h = x, F.linear(x[:, start:].to(a_cat.dtype), a_cat)
            if ranks is not None:
                all_reduce_sum(shared.h, ranks)
        h = shared.h if whole else shared.h.narrow(-1, offset, rank)
        if torch.is_grad_enabled():
            delta = F.linear(h, b)
            return torch.cat([y[:, :start], y[:, start:] + (delta * scaling).to(y.dtype)], 1)
        draft = y[:, start:]
        if y.dtype != b.dtype:  # e.g. PEFT's fp32 LoRA on a bf16 base
            draft.add_(F.linear(h, b).to(y.dtype), alpha=scaling)
        elif draft.shape[0] == 1:
            draft[0].addmm_(h[0], b_t, alpha=scaling)
        else:
            draft.baddbmm_(h, b_t.expand(draft.shape[0], -1, -1), alpha=scaling)
        return y
    return forward


def _delta_hook(a: torch.Tensor, b: torch.Tensor, scaling: float, select: torch.Tensor | None, ranks=None):
    def hook(module, args, output):
        x = args[0]
        h = F.linear(x.to(a.dtype), a)
        if ranks is not None:  # a row-wise tensor-parallel layer: every rank's partial product, summed
            all_reduce_sum(h, ranks)
        delta = F.linear(h, b) * scaling
        adapted = output + delta.to(output.dtype)
        return adapted if select is None else torch.where(select.to(output.device), adapted, output)
    return hook


def _targets(model, target_modules: list[str]) -> dict[str, nn.Linear]:
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in target_modules}
    if not found:
        raise ValueError(f"No Linear layer of {type(model).__name__} is named one of {target_modules}")
    return found


def add_draft_adapter(model, rank: int, alpha: float, target_modules: list[str]) -> DraftAdapter:
    """Attach a fresh drafting adapter (the identity until trained) as `model.draft_adapter`; the base weights are
    frozen, the adapter's trainable."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.draft_adapter = DraftAdapter(_targets(model, target_modules), rank, alpha, target_modules,
                                       input_device(model))
    return model.draft_adapter


def save_draft_adapter(model, directory: str | Path, dtype: torch.dtype | None = None):
    """Write `model.draft_adapter` as a PEFT LoRA folder (its weights as `dtype`, default their own)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    adapter = model.draft_adapter
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, target_modules=adapter.target_modules, lora_dropout=0.0,
               bias="none").save_pretrained(directory)
    tensors = {}
    for name, a, b in zip(adapter.names, adapter.lora_A, adapter.lora_B):
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = a.detach().to(dtype or a.dtype).contiguous().cpu()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = b.detach().to(dtype or b.dtype).contiguous().cpu()
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})


def attach_draft_adapter(model, directory: str | Path) -> DraftAdapter:
    """Attach the adapter saved in `directory` (PEFT LoRA format) as `model.draft_adapter`, frozen."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = json.loads((directory / "adapter_config.json").read_text())
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("peft_type", "LORA") != "LORA":
        raise NotImplementedError(f"{directory}: only plain LoRA adapters are supported for drafting")
    weights = load_file(directory / "adapter_model.safetensors")
    names = sorted({k.removeprefix(_PREFIX).rsplit(".lora_", 1)[0] for k in weights})
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise ValueError(f"{directory}: adapter weights for {missing[:3]} match no Linear of {type(model).__name__}")
    adapter = DraftAdapter({n: modules[n] for n in names}, cfg["r"], cfg["lora_alpha"], list(cfg["target_modules"]),
                           input_device(model))
    with torch.no_grad():
        for i, n in enumerate(names):
            adapter.lora_A[i].copy_(weights[f"{_PREFIX}{n}.lora_A.weight"])
            adapter.lora_B[i].copy_(weights[f"{_PREFIX}{n}.lora_B.weight"])
    adapter.requires_grad_(False)
    model.draft_adapter = adapter
    return adapter


def attach_adapter(model: nn.Module, folder, placed: bool):
    """A PEFT LoRA folder (NLD's drafting LoRA) on `model`: as a `PeftModel` on one device; on a model placed past one
    device (`placed`: a device map or tensor parallel) as the model's own drafting adapter (`draft_adapter.py`, the
    same LoRA maths and file format), whose weights sit where each layer computes and are sliced with a sharded
    layer. (PEFT re-dispatches a model with offloaded layers and offloads the LoRA weights with them.)"""
    if not placed:
        from peft import PeftModel

        return PeftModel.from_pretrained(model, folder)
    attach_draft_adapter(model, folder)
    return model
