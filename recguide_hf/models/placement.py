"""Where a model's layers and shards live: accelerate's device maps and transformers' tensor parallelism.

Two ways past one device, both transformers' own:

* **a device map** (`from_pretrained(..., device_map="auto" | {...}, offload_folder=...)`): accelerate places whole
  layers on several devices, or offloads them to `"cpu"` / `"disk"`, and its hooks move each layer's inputs to the
  layer's *execution device* (where an offloaded layer's weights are loaded for its forward; its parameters
  themselves sit on `meta`). The row cache makes each layer's buffers where that layer writes (`cache.py`), the
  backbone feeds inputs where the embeddings run (`input_device`), and the drafting adapter's weights live beside
  the layer they adapt (`execution_device`);
* **tensor parallelism** (`from_pretrained(..., tp_plan="auto")` under `torchrun`): every rank holds a slice of every
  layer (its weights are DTensors): `num_key_value_heads / world_size` KV heads per rank (the row cache sizes its
  buffers from the states it is given), column-wise layers give a slice of their outputs, row-wise layers sum
  partial outputs across ranks. The drafting LoRA is sliced the same way (`local_lora`), and every rank must run
  the same rounds: a round's wall time, which the adaptive policy reads, is agreed across ranks (`agree_max`: the
  slowest rank's, which is the round's time anyway, since the ranks meet at every all-reduce); `generate` refuses
  `max_time` on such a model (a clock per rank would stop them at different rounds).

Nothing here is needed on one device: every function returns its input (or the one device) unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch build without distributed: nothing can be sharded
    DTensor = Shard = None


def _hook_device(module: nn.Module) -> torch.device | None:
    """The execution device of accelerate's hook on `module` itself, or None (no hook, or one that places nothing)."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is None:  # a SequentialHook: the first of its hooks that places the module
        device = next((h.execution_device for h in getattr(hook, "hooks", ()) if
                       getattr(h, "execution_device", None) is not None), None)
    if device is None:
        return None
    return torch.device(device if not isinstance(device, int) else f"cuda:{device}")


def execution_device(module: nn.Module, fallback: torch.device | None = None) -> torch.device:
    """The device `module` computes on: accelerate's execution device for a hooked (placed or offloaded) module,
    else the device of its first parameter; `fallback` where that is `meta` (a module offloaded inside a block whose
    one hook, above it, loads it: the model's execution device)."""
    device = _hook_device(module)
    if device is not None:
        return device
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    return fallback if device.type == "meta" and fallback is not None else device


def input_device(model: nn.Module) -> torch.device:
    """Where `model` takes its token ids: the execution device of its input embeddings."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # remote code with its own names: its first parameter's device
        embeddings = None
    device = execution_device(embeddings if embeddings is not None else model)
    if device.type == "meta":  # placed whole, by one hook above the embeddings (transformers 5.0, all offloaded)
        device = next((d for m in model.modules() if (d := _hook_device(m)) is not None), device)
    if device.type == "meta":
        raise ValueError("The model's embeddings are on the meta device with no accelerate hook to run them: load it "
                         "with from_pretrained(..., device_map=...) (and offload_folder= for offloaded layers)")
    return device


def device_map_of(model: nn.Module) -> dict | None:
    """accelerate's placement of `model` where it spans more than one device or offloads a layer (None: one place)."""
    placed = getattr(model, "hf_device_map", None)
    places = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in (placed or {}).values()}
    if len(places) > 1:
        return placed
    if any(p.device.type == "meta" for p in model.parameters()):  # offloaded: transformers 5.0 keeps no map for "auto"
        return placed or {"": "offloaded"}
    return None


def tp_group(model: nn.Module):
    """The process group of a tensor-parallel model (`from_pretrained(..., tp_plan=...)`), or None."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        weight = next((p for p in model.parameters() if _is_dtensor(p)), None)
        mesh = weight.device_mesh if weight is not None else None
    if mesh is not None and mesh.ndim > 1:  # a mesh of several kinds of parallelism: its tensor-parallel part
        mesh = mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
    if mesh is None or mesh.size() == 1:
        return None
    return mesh.get_group()


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def is_sharded(linear: nn.Linear) -> bool:
    """Whether `linear`'s weight is a tensor-parallel shard (a DTensor)."""
    return _is_dtensor(linear.weight)


def is_plain(linear: nn.Linear) -> bool:
    """Whether `linear`'s weight is an ordinary tensor where it runs (not a shard, not offloaded to `meta`)."""
    return not is_sharded(linear) and linear.weight.device.type != "meta"


def local_lora(linear: nn.Linear, a: torch.Tensor, b: torch.Tensor):
    """(A, B, group): a LoRA's `A` [r, in] and `B` [out, r] as this rank's slice of `linear` needs them, and the
    process group whose ranks' `A x` products must be summed (None: nothing to sum).

    A column-wise layer (weight sharded on its outputs) sees the whole input and gives its slice of the outputs: it
    takes its rows of `B`. A row-wise layer sees its slice of the input and its outputs are summed across ranks: it
    takes its columns of `A`, and `A x` (r numbers a token, the cheapest place) is summed across ranks before `B`.
    An unsharded layer takes both whole."""
    weight = linear.weight
    if not _is_dtensor(weight):
        return a, b, None
    from torch.distributed.tensor import Replicate, distribute_tensor

    placements, mesh = weight.placements, weight.device_mesh
    if len(placements) != 1 or type(placements[0]) not in (Shard, Replicate):  # packed, strided, several meshes
        raise NotImplementedError(f"A drafting LoRA on a layer sharded as {placements} over a {mesh.ndim}-D mesh is "
                                  "not supported: only plain column-wise and row-wise tensor-parallel layers are")
    if isinstance(placements[0], Replicate):
        return a, b, None
    if placements[0].dim % weight.ndim == 0:  # column-wise: this rank's output features
        return a, distribute_tensor(b.detach(), mesh, [Shard(0)], src_data_rank=None).to_local(), None
    local_a = distribute_tensor(a.detach(), mesh, [Shard(1)], src_data_rank=None).to_local()
    return local_a, b, mesh.get_group()


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum `t` across the ranks of `group` in place (a row-wise layer's partial LoRA product)."""
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t


def agree_max(values: list[float], group, device: torch.device) -> list[float]:
    """The largest of each value across the ranks of `group` (its tensor on `device`, this rank's): one number every
    rank then reads alike."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def tensor_parallel_kwargs(plan: str | dict = "auto") -> dict:
    """`from_pretrained` arguments that shard a model over the ranks of this `torchrun` job by `plan` ("auto": the
    model's own plan; a dict: `nld.nld_tp_plan()` and the like). transformers starts the process group itself."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: the plan is a keyword of its own
        return {"tp_plan": plan}
    return {"distributed_config": DistributedConfig(tp_plan=plan)}

