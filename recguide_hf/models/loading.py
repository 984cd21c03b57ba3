"""Loading a model folder as the CLI, the server and its Ray replicas do: tokenizer and model, offline,
`trust_remote_code`, placed on one device, by accelerate's device map, or sharded over a `torchrun` job."""

from __future__ import annotations

from pathlib import Path

from .. import BUNDLED_MODEL


def load(model_dir: str | Path | None, dtype: str = "auto", device: str = "cpu", adapter: str | None = None,
         with_tokenizer: bool = True, device_map: str | dict | None = None, offload_folder: str | None = None,
         tp: bool = False, **model_kwargs):
    """Tokenizer and model from a folder (default: the bundled recguide-tiny), offline, trust_remote_code.

    `adapter`: a PEFT adapter folder (NLD's drafting LoRA) attached on top; the engine routes it to draft
    tokens only, so the verifier still runs the base weights. `device_map` (with `offload_folder` for layers it
    puts on "disk"): accelerate places the model instead of `device`; `tp`: shard it over this `torchrun` job's
    ranks (tensor parallel; NLD folders by `nld_tp_plan`). `model_kwargs` go to `from_pretrained` (e.g.
    `draft_adapter=False`: the bundled model without its drafting adapter)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir) if model_dir else BUNDLED_MODEL
    if not path.exists():
        raise SystemExit(f"Model folder {path} not found")
    torch_dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True) if with_tokenizer else None
    auto_map = getattr(AutoConfig.from_pretrained(path, trust_remote_code=True), "auto_map", None) or {}
    # NLD-style folders register only AutoModel (encoder + diffusion head, no causal-LM class)
    auto_class = AutoModel if auto_map and "AutoModelForCausalLM" not in auto_map else AutoModelForCausalLM
    placed = {}
    if tp:
        from .nld import nld_tp_plan
        from .placement import tensor_parallel_kwargs
        placed = tensor_parallel_kwargs(nld_tp_plan() if auto_class is AutoModel else "auto")
    elif device_map is not None:
        placed = {"device_map": device_map, **({"offload_folder": offload_folder} if offload_folder else {})}
    model = auto_class.from_pretrained(path, trust_remote_code=True, dtype=torch_dtype, **placed, **model_kwargs)
    if adapter:
        try:
            import peft  # noqa: F401
        except ImportError as err:
            raise SystemExit("--adapter needs the `peft` package (pip install peft)") from err
        if not Path(adapter).exists():
            raise SystemExit(f"Adapter folder {adapter} not found")
        from .draft_adapter import attach_adapter

        model = attach_adapter(model, adapter, placed=bool(placed))
    return tokenizer, (model if placed else model.to(device)).eval()
