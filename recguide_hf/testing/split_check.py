"""Greedy decoding of a model split past one device, recorded for comparison with plain greedy decoding.

The tests and the GPU session run it; it compares nothing itself (the caller does, across runs and ranks):

    # tensor parallel: every rank writes its own record
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \\
        -m recguide_hf.testing.split_check --model DIR --tp --out OUT
    # accelerate's device map (here: layer 1 offloaded to disk), or the reference: no placement at all
    python -m recguide_hf.testing.split_check --model DIR --device-map '{"": "cpu", "model.layers.1": "disk"}' \\
        --offload-folder OFF --out OUT
    # a test model folder to run it on (`tiny`: the bundled model's class, 4 heads / 2 KV heads, a drafting LoRA on
    # every linear layer; `nld`: the NLD stand-in), and the comparison of a record with a reference record
    python -m recguide_hf.testing.split_check --make tiny DIR
    python -m recguide_hf.testing.split_check --compare OUT/rank0.json REF/rank0.json

Per prompt batch (one prompt; a left-padded batch of four) and method it records the output rows (fp32, greedy):
`hf`, plain greedy decoding as the model's own code does it (HF's `generate`; an NLD model's own `ar_generate`
row by row), then the engine's `plain` (B = 1 steps), `linear` (LinearSS, B = 4) and `recguide` (the auto policy
on the bundled model's cost and value tables, which the folder need not have). For the engine's methods it also
records each round's planned block size per row (the policy's `plan`, wrapped here), which must be the same on
every rank of a tensor-parallel run, and the drafts the verifier accepted (the drafting adapter at work). Last, a
sampled RecGuide call from one seed (`sampled`): ranks seeded alike must draw the same tokens.

Prompts are seeded random token ids in [12, min(vocab, 100)) less the model's special tokens, so a folder needs no
tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

EVERY_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = ("batch1", "batch4")
ROUTES = ("every", "suffix", "tokens")  # how a forward's drafting tokens are marked (`draft_adapter.route`)
METHODS = {"plain": {"recguide_mode": "linear", "recguide_block_size": 1},
           "linear": {"recguide_mode": "linear", "recguide_block_size": 4},
           "recguide": {"recguide_mode": "recguide", "recguide_block_size": "auto"}}


def write_tiny_folder(directory) -> Path:
    """A random model of the bundled class that tensor parallelism can shard over 2 ranks (4 heads, 2 KV heads),
    with a random drafting LoRA on every linear layer as the bundled model has (a fresh LoRA would be the identity)."""
    from ..models.draft_adapter import ADAPTER_DIR, add_draft_adapter, save_draft_adapter
    from ..models.export import save_model_folder
    from ..models.modeling import RecGuideConfig, RecGuideForCausalLM

    directory = Path(directory)
    torch.manual_seed(0)
    config = RecGuideConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            bos_token_id=0, eos_token_id=1, pad_token_id=2, mask_token_id=3, initializer_range=0.3,
                            tie_word_embeddings=False, block_size=4)  # a large init: peaked logits, few near-ties
    model = RecGuideForCausalLM(config).eval()
    save_model_folder(model, None, directory, recguide_block_size=4)
    add_draft_adapter(model, rank=4, alpha=8, target_modules=list(EVERY_LINEAR))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_draft_adapter(model, directory / ADAPTER_DIR)
    return directory


def layout_tolerance(expected: torch.Tensor, ulps: int = 64) -> float:
    """How far two computation layouts of the same fp32 numbers (other kernels, groupings, a sum split across ranks)
    may differ: `ulps` units of the last place at the values' scale (~1e-5 of it), far below what a layout bug moves
    (a query seeing one wrong key, a LoRA on the wrong token: a sizeable fraction of the scale)."""
    return ulps * 2 ** -23 * expected.abs().max().item()


def problems(record: dict, reference: dict | None = None) -> list[str]:
    """What a record gets wrong: an engine method's rows that differ from plain greedy of the same run, plain greedy
    that differs from the reference run's (one device), the drafting adapter's logits off the reference's by more
    than `layout_tolerance` or no different from the adapter-off logits (an adapter that did nothing)."""
    found = []
    for case in CASES:
        got = record[case]
        found += [f"{case}: {m} != hf" for m in METHODS if got[m] != got["hf"]]
        if reference is not None and got["hf"] != reference[case]["hf"]:
            found.append(f"{case}: hf != the reference's hf")
    probe = {k: torch.tensor(record["draft_probe"][k]) for k in (*ROUTES, "off")}
    for route in ROUTES:
        if float((probe[route] - probe["off"]).abs().max()) <= 0.1:
            found.append(f"draft probe: {route} is the adapter-off logits")
        if reference is not None:
            expected = torch.tensor(reference["draft_probe"][route])
            gap = float((probe[route] - expected).abs().max())
            if gap > layout_tolerance(expected):
                found.append(f"draft probe: {route} off the reference by {gap:.3g}")
    return found


def prompts(model, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` seeded prompts of 3 to 9 tokens, left-padded: (ids [N, W], attention mask [N, W])."""
    from ..core.masks import left_pad

    cfg = model.config
    special = {getattr(cfg, k, None) for k in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")}
    pool = torch.tensor([t for t in range(12, min(cfg.vocab_size, 100)) if t not in special])
    g = torch.Generator().manual_seed(seed)
    rows = [pool[torch.randint(len(pool), (int(n),), generator=g)] for n in torch.randint(3, 10, (batch,), generator=g)]
    return left_pad(rows, cfg.pad_token_id if cfg.pad_token_id is not None else 0)


def plain_greedy(model, ids, mask, max_new_tokens: int) -> torch.Tensor:
    """The model's own greedy decoding: HF's `generate`, or NLD's `ar_generate` (a model without GenerationMixin)."""
    from transformers import GenerationMixin

    if isinstance(model, GenerationMixin):
        return GenerationMixin.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        do_sample=False)
    from .nld_standin import ar_greedy

    cfg = model.config
    return ar_greedy(model, ids, mask, max_new_tokens, eos=cfg.eos_token_id, pad=cfg.pad_token_id,
                     mask_id=cfg.mask_token_id)


def record_plans():
    """Wrap `BlockPolicy.plan` so every round's planned block sizes (per row) are kept; returns the list."""
    from ..core.policy import BlockPolicy

    plans: list[list[int]] = []
    original = BlockPolicy.plan

    def plan(self, *args, **kwargs):
        planned = original(self, *args, **kwargs)
        plans.append(planned.tolist())
        return planned

    BlockPolicy.plan = plan
    return plans


@torch.no_grad()
def draft_probe(model, seed: int) -> dict:
    """Logits [Q, V] of one bidirectional block over a fresh cache with the drafting adapter routed three ways (every
    token drafts: `every`; tokens from column 2 on: `suffix`; a bool mask on odd columns: `tokens`) and off (`off`):
    where the adapter's weights sit beside offloaded or sharded layers, these must equal the one-device numbers."""
    from ..core.masks import block_intra, build_mask
    from ..models.registry import as_backbone

    backbone = as_backbone(model)
    ids = prompts(model, 1, seed)[0].to(backbone.device)
    n = ids.shape[1]
    columns = torch.arange(n, device=ids.device)
    out = {}
    for name, draft_mask in zip((*ROUTES, "off"), (0, 2, (columns % 2 == 1)[None], None)):
        cache = backbone.new_cache(1, n)
        cache.bind(torch.tensor([0], device=ids.device), n)
        mask = build_mask(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), block_intra(1, n), n)
        logits = backbone.forward(ids, columns[None], mask.to(ids.device), cache, draft_mask=draft_mask)
        out[name] = logits[0].float().cpu().tolist()
    # how the model was split, as the forward saw it: KV heads per layer of the cache it wrote, sharded weights
    out["kv_heads"] = [k.shape[1] for k in cache.keys]
    out["sharded"] = sum(type(p).__name__ == "DTensor" for p in model.parameters())
    out["offloaded"] = sum(p.device.type == "meta" for p in model.parameters())
    return out


def run(model, max_new_tokens: int, seed: int) -> dict:
    import recguide_hf
    from recguide_hf import BUNDLED_MODEL

    from ..models.registry import as_backbone

    device = as_backbone(model).device
    tables = {"recguide_cost_table": str(BUNDLED_MODEL / "cost_table.json"),
              "recguide_value_table": str(BUNDLED_MODEL / "value_table.json")}
    plans = record_plans()
    out = {}
    for batch in (1, 4):
        ids, mask = (t.to(device) for t in prompts(model, batch, seed + batch))
        case = {"prompt": ids.tolist(), "hf": plain_greedy(model, ids, mask, max_new_tokens).tolist()}
        for name, settings in METHODS.items():
            del plans[:]
            extra = tables if name == "recguide" else {}
            result = recguide_hf.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          do_sample=False, return_dict_in_generate=True, **settings, **extra)
            case[name], case[f"{name}_plans"] = result.sequences.tolist(), [list(p) for p in plans]
            case[f"{name}_accepted"] = result.recguide_stats["accepted_drafts"]  # drafts the verifier accepted
        # speculative sampling from one seed: tensor-parallel ranks seeded alike must draw alike (not vs plain greedy)
        torch.manual_seed(seed)
        case["sampled"] = recguide_hf.generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                               do_sample=True, temperature=1.0, **METHODS["recguide"],
                                               **tables).tolist()
        out[f"batch{batch}"] = case
    out["draft_probe"] = draft_probe(model, seed)
    return out


def load(folder: str, tp: bool, device_map, offload_folder: str | None):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import recguide_hf  # noqa: F401  (registers the bundled model class)

    from ..models.draft_adapter import attach_adapter
    from ..models.nld import nld_tp_plan
    from ..models.placement import tensor_parallel_kwargs

    auto_map = getattr(AutoConfig.from_pretrained(folder, trust_remote_code=True), "auto_map", None) or {}
    nld = bool(auto_map) and "AutoModelForCausalLM" not in auto_map
    placed = {}
    if tp:
        placed = tensor_parallel_kwargs(nld_tp_plan() if nld else "auto")
    elif device_map is not None:
        placed = {"device_map": device_map, **({"offload_folder": offload_folder} if offload_folder else {})}
    cls = AutoModel if nld else AutoModelForCausalLM
    model = cls.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32, **placed)
    lora = Path(folder) / "draft_lora"
    if nld and lora.exists():  # NLD's drafting LoRA: a PEFT adapter beside the base weights
        model = attach_adapter(model, lora, placed=bool(placed))
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", nargs=2, metavar=("KIND", "DIR"), help="write a test model folder: tiny or nld")
    parser.add_argument("--compare", nargs=2, metavar=("RECORD", "REFERENCE"),
                        help="print what RECORD gets wrong against REFERENCE (exit 1 if anything)")
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--device-map", type=json.loads, default=None)
    parser.add_argument("--offload-folder", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.make:
        from .nld_standin import write_standin_folder

        kind, folder = args.make
        print((write_tiny_folder if kind == "tiny" else write_standin_folder)(folder))
        return 0
    if args.compare:
        record, reference = (json.loads(Path(f).read_text()) for f in args.compare)
        found = problems(record, reference)
        print("\n".join(found) or f"{args.compare[0]}: every method = plain greedy = the reference's, adapter logits "
                                   "within the layout tolerance")
        return 1 if found else 0
    if not (args.model and args.out):
        parser.error("--model and --out are needed to run the check")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model = load(args.model, args.tp, args.device_map, args.offload_folder)
    record = run(model, args.max_new_tokens, args.seed)
    rank = torch.distributed.get_rank() if args.tp else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if args.tp:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
