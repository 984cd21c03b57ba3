"""The last steps of `recguide distill`: the policy's tables, then the exported Hub folder and its model card.

Everything but the base's own files is gathered in `WORK/parts/` (`draft_lora/`, `value_table.json`,
`cost_table.json`, `settings.json`, `README.md`): that is what a known model ships in this repository
(`recguide_hf/bundled/<name>/`), and `models.export.assemble_folder` joins it to the base's files.
"""

from __future__ import annotations

import json
import platform
import shlex
from pathlib import Path

import torch

from ...models.export import assemble_folder


def base_of(args, work: Path) -> Path:
    """The base folder the export links: the given one, or `WORK/base` when a MASK token had to be added."""
    return work / "base" if (work / "base" / "config.json").exists() else args.base


def save_parts(args, model, work: Path) -> Path:
    """The trained adapter (as `--adapter-dtype`) and settings into WORK/parts."""
    from ...models.draft_adapter import attach_draft_adapter, save_draft_adapter

    parts = work / "parts"
    final = work / "run" / "final"
    if not hasattr(model, "draft_adapter"):
        attach_draft_adapter(model, final)
    save_draft_adapter(model, parts / "draft_lora", dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[
        args.adapter_dtype]))
    log = json.loads((final / "distill_log.json").read_text())
    # the base's folder is a path on the machine that made it: the shipped log names it BASE, as the card does
    log["args"] = {k: str(v).replace(str(args.base), "BASE") for k, v in log["args"].items()
                   if k not in ("func", "cli_argv", "command_line")}
    (parts / "draft_lora" / "distill_log.json").write_text(json.dumps(log, indent=1))
    (parts / "settings.json").write_text(json.dumps(folder_settings(args), indent=1) + "\n")
    return parts


def folder_settings(args) -> dict:
    """What `settings.json` ships and `assemble_folder` writes into the folder's config and generation config."""
    return {"block_size": args.block_size, "recguide_first_draft": getattr(args, "first_draft", "mask")}


def tables(args, model, tokenizer, work: Path) -> None:
    """The value table (calibrated on training-split prompts, never the held-out ones) and this machine's cost
    table, measured on the assembled folder loaded as a user loads it."""
    from transformers import AutoModelForCausalLM

    from ..profile import calibrate_table, profile_costs
    from .prompts import prompt_mix

    parts = save_parts(args, model, work)
    step = json.loads((parts / "draft_lora" / "distill_log.json").read_text())["step"]
    value = parts / "value_table.json"
    if value.exists() and json.loads(value.read_text()).get("calibration", {}).get("adapter_step") != step:
        print(f"value table: calibrated on another adapter than step {step}'s: calibrating again", flush=True)
        value.unlink()  # acceptance is the adapter's: a run trained on needs it measured again (costs are not)
    if value.exists() and (parts / "cost_table.json").exists():
        return
    folder = assemble_folder(base_of(args, work), parts, work / "folder", model.config.mask_token_id, link=True,
                             **folder_settings(args))  # read only, in the work folder
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    loaded.to(args.device).eval()
    if not (parts / "value_table.json").exists():
        prompts = prompt_mix("train", tokenizer, args.calibrate_prompts, args.chat_share, seed=args.seed + 1)
        table = calibrate_table(loaded, {"train": prompts}, args.profile_block_sizes,
                                max_new_tokens=args.calibrate_tokens, pad_token_id=tokenizer.pad_token_id)
        table["calibration"] = {"prompts": "training-split mix (recguide distill)", "num_prompts": len(prompts),
                                "max_new_tokens": args.calibrate_tokens, "adapter_step": step}
        (parts / "value_table.json").write_text(json.dumps(table, indent=1) + "\n")
    if not (parts / "cost_table.json").exists():
        table = profile_costs(loaded, args.profile_concurrency, args.profile_block_sizes, repeats=args.profile_repeats)
        (parts / "cost_table.json").write_text(json.dumps(table, indent=1) + "\n")


def card(args, tokenizer, work: Path, parts: Path) -> str:
    log = json.loads((parts / "draft_lora" / "distill_log.json").read_text())
    last = log["log"][-1]
    first = log["log"][0]
    commands = [portable(c, args) for c in (work / "command.txt").read_text().strip().splitlines()] \
        if (work / "command.txt").exists() else []
    sets = sorted({k.split("_", 2)[2] for k in last if k.startswith("tau_B")}, key=lambda s: (s == "train", s))
    rows = "\n".join(f"| {s} | " + " | ".join(f"{first.get(f'tau_B{b}_{s}', '-')} -> {last.get(f'tau_B{b}_{s}', '-')}"
                                              for b in (4, 8, 16)) + f" | {_yes(last.get(f'equal_{s}'))} |"
                     for s in sets)
    teacher = log.get("teacher_rows", {})
    size = sum(f.stat().st_size for f in (parts / "draft_lora").glob("*.safetensors"))
    adapter = json.loads((parts / "draft_lora" / "adapter_config.json").read_text())
    targets = ", ".join(sorted(adapter["target_modules"]))
    vocab = "extended by it" if (work / "base").exists() else "unchanged (an existing token the base does not use)"
    # what the commands alone do not say (where an --init or a linked teacher/ came from): the run's owner writes it
    note = (work / "card_note.md").read_text().strip() + "\n\n" if (work / "card_note.md").exists() else ""
    return f"""---
license: {args.license}
base_model: {args.base_name or args.base.name}
tags: [recguide, self-speculative, speculative-decoding]
---
# {(args.base_name or args.base.name).split("/")[-1]}, self-speculative

The base model, unchanged, plus a drafting LoRA that only draft tokens see (NLD's recipe): with RecGuide decoding
(`model.generate` through this folder's `custom_generate`, loaded with `trust_remote_code=True`) the output is the
base model's own greedy output, token for token; where drafting pays on the hardware (its cost table decides: on a
small CPU it often does not, and the policy takes plain steps), in fewer forwards.

* MASK token: `{tokenizer.convert_ids_to_tokens(log_mask(work))}` (id {log_mask(work)}); the vocabulary is {vocab}.
* Drafting LoRA: rank {adapter["r"]}, alpha {adapter["lora_alpha"]}, on {targets};
  {log["trainable_parameters"] / 1e6:.2f}M parameters, stored as {args.adapter_dtype} ({size / 2**20:.1f} MiB).
* Trained by self-distillation on the base's own greedy continuations: {teacher.get("rows")} rows,
  {teacher.get("continuation_tokens")} continuation tokens ({teacher.get("seconds")} s to generate), chat instructions
  and raw code from the Python standard library's training split; {log["step"]} steps, {log["elapsed"] / 60:.1f}
  minutes ({log["cpu_seconds"] / 3600:.2f} CPU core-hours: the process's CPU time) on {platform.machine()} /
  {args.device}.

## Measured acceptance (decoding, held-out prompts)

tau(B): tokens per round of LinearSS greedy decoding through the engine at block size B, {args.new_tokens} new tokens,
on held-out prompts (files training never saw; `train`: as many training prompts, to show overfitting), before ->
after training; "= greedy": every output equalled the base's greedy continuation. The first draft comes from
{"the seed's own causal logits (`recguide_first_draft=verifier`)" if getattr(args, "first_draft", "mask") == "verifier"
 else "the first mask position"}.

| set | B = 4 | B = 8 | B = 16 | = greedy |
|---|---|---|---|---|
{rows}

## How it was made

`BASE` is the base model's folder{base_note(args)}.

```
{chr(10).join(commands)}
```

{note}`recguide distill` resumes from its work folder: the same command continues a stopped run. Its budgets are
wall-clock (`--teacher-minutes`, `--minutes`): the same commands on another machine run the same recipe for the same
time, so the number of teacher rows and of training steps (and so the weights) follow that machine's speed.
"""


def _yes(flag) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def portable(command: str, args) -> str:
    """A `recguide distill` command as the card quotes it: the base folder (a path on the machine that made it) as
    `BASE`, other absolute paths by their name."""
    words = shlex.split(command)
    base = {str(args.base), str(Path(args.base).resolve())}
    words = ["BASE" if w in base or (i == 2 and w.startswith("/")) else (Path(w).name if w.startswith("/") else w)
             for i, w in enumerate(words)]
    return " ".join(shlex.quote(w) if w != "BASE" else w for w in words)


def base_note(args) -> str:
    from ...models.known import KNOWN_MODELS

    for name in KNOWN_MODELS:
        if Path(args.base).name == f"{name}-base":  # where `recguide fetch` converts a known model's base
            return (f" ({args.base_name or name}): the one `recguide fetch {name}` converts, "
                    f"`~/.cache/recguide/{name}-base`")
    return f" ({args.base_name})" if args.base_name else ""


def log_mask(work: Path) -> int:
    return json.loads((work / "mask.json").read_text())["mask_token_id"]


def export(args, model, tokenizer, work: Path) -> Path:
    parts = work / "parts"
    if not (parts / "draft_lora").exists():
        save_parts(args, model, work)
    (parts / "README.md").write_text(card(args, tokenizer, work, parts))
    out = assemble_folder(base_of(args, work), parts, args.out, model.config.mask_token_id,
                          weights=not args.no_weights, **folder_settings(args))
    print(f"exported {out}{' (without the base weights)' if args.no_weights else ''}", flush=True)
    return out
