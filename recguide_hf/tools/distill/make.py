"""`recguide distill BASE OUT`: make a causal LM self-speculative (NLD's recipe) and export it as a Hub folder.

    recguide distill ~/.cache/recguide/smollm2-base runs/smollm2 --mask-token "<empty_output>" --minutes 90

The steps, each skipped when its output exists in the work folder (`--work`, default `OUT.work`), so a run that
stops (a time budget, a closed session) continues where it stopped when the same command is run again:

1. MASK token: `--mask-token` names a token; one the vocabulary has (best: one the base never uses, so the base
   model stays exactly as it was) is taken, any other is added (embedding rows resized; the new row is the mean
   row). Default: the tokenizer's mask token, else `<|mask|>`.
2. Teacher rows (`teacher.py`): the base's own greedy continuations of prompts from this disk (`prompts.py`:
   chat instructions through its chat template, raw code), `--teacher-minutes` for training rows; held-out rows
   from files training never sees, for the tau curve.
3. Distillation (`loop.py`): a drafting LoRA on every linear layer, trained so draft blocks `[x_t, MASK...]`
   predict the frozen verifier's greedy tokens; `--minutes` of training in all (across runs), checkpoints every
   few minutes, and every `--eval-minutes` tau(B) as decoding sees it: LinearSS through the engine on the held-out
   prompts (and on as many training prompts), its output checked against the rows (`measure.py`).
4. Tables: the value table (`recguide calibrate`'s fit) and this machine's cost table (`recguide profile`).
5. Export: weights (or, with `--no-weights`, only what the base lacks), config with `mask_token_id` and the remote
   code map, generation config, shims, `draft_lora/`, tables, and a model card with the measured tau and the
   command that trained it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

STEPS = ("mask", "teacher", "train", "tables", "export")


def load_base(base: Path, mask_token: str | None, device: str = "cpu"):
    """The frozen base (fp32, eval) and its tokenizer, with `config.mask_token_id` set. The MASK token is
    `mask_token`, else the tokenizer's own mask token, else `<|mask|>`: taken when the vocabulary has it, added
    otherwise (the embedding rows resized, the new row the mean of the others). Returns (model, tokenizer, added)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    name = mask_token or tokenizer.mask_token or "<|mask|>"
    added = name not in tokenizer.get_vocab()
    if added:
        tokenizer.add_special_tokens({"mask_token": name})
        rows = model.get_input_embeddings().weight.shape[0]
        new_id = tokenizer.convert_tokens_to_ids(name)
        if new_id >= rows:
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        else:  # a padded embedding (Qwen's): the token takes an unused row, set to the mean of the others
            with torch.no_grad():
                for emb in {id(e): e for e in (model.get_input_embeddings(), model.get_output_embeddings())
                            if e is not None}.values():
                    emb.weight[new_id] = emb.weight[:len(tokenizer) - 1].mean(0)
    model.config.mask_token_id = tokenizer.convert_tokens_to_ids(name)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval(), tokenizer, added


def heldout_sets(tokenizer, per_set: int) -> dict[str, list[list[int]]]:
    """Held-out prompts: chat instructions from held-out stdlib files (through the chat template, when there is
    one) and the project's held-out raw code prompts (their last 160 tokens)."""
    from ..prompts import load_prompts
    from .prompts import chat_prompt_ids, chat_prompts

    sets = {"code": [tokenizer(t, add_special_tokens=False)["input_ids"][-160:]
                     for t in load_prompts("code")[:per_set]]}
    if getattr(tokenizer, "chat_template", None) is not None:
        texts = chat_prompts("heldout")[::7][:per_set]
        sets["chat"] = [chat_prompt_ids(tokenizer, t) for t in texts]
    return sets


def step_teacher(args, model, tokenizer, work: Path) -> None:
    from .prompts import prompt_mix
    from .teacher import Offers, make_teacher_rows, prompts_in, shards_info, train_shards

    teacher = work / "teacher"
    mask_id = model.config.mask_token_id
    for name, prompts in heldout_sets(tokenizer, args.eval_prompts).items():
        path = teacher / f"heldout_{name}.npz"
        if not path.exists():
            print(f"held-out {name} rows: {len(prompts)} prompts", flush=True)
            make_teacher_rows(model, tokenizer, prompts, path, args.new_tokens, args.teacher_batch, mask_id=mask_id)
    # `--teacher-minutes` is the budget in all: a later run given more adds a shard of prompts not made yet
    shards = train_shards(teacher)
    left = args.teacher_minutes - shards_info(teacher)["seconds"] / 60
    offers = Offers(teacher)
    offer = {"teacher_prompts": args.teacher_prompts, "chat_share": args.chat_share, "seed": args.seed}
    if shards and (left < 1 or offer in offers.made):
        return
    prompts = prompt_mix("train", tokenizer, args.teacher_prompts, args.chat_share, seed=args.seed)
    made = set().union(offers.dropped, *(prompts_in(p) for p in shards))
    prompts = [p for p in prompts if tuple(p) not in made]
    if not prompts:
        print(f"teacher rows: all {args.teacher_prompts} prompts offered are made (--teacher-prompts offers more)")
        offers.record(offer)
        return
    path = teacher / ("train.npz" if not shards else f"train_{len(shards) + 1}.npz")
    print(f"teacher rows: {len(prompts)} new prompts, {left:.0f} min -> {path.name}", flush=True)
    info = make_teacher_rows(model, tokenizer, prompts, path, args.new_tokens, args.teacher_batch, left,
                             mask_id=mask_id)
    dropped = info.pop("dropped_prompts")
    offers.record(offer if info["rows"] + len(dropped) == len(prompts) else None, dropped)
    print(json.dumps(info), flush=True)


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="recguide distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path, help="a causal LM folder (Llama, Qwen2/3, Mistral families)")
    p.add_argument("out", type=Path, help="where the self-speculative Hub folder is written")
    p.add_argument("--work", type=Path, default=None, help="work folder (teacher rows, checkpoints; default OUT.work)")
    p.add_argument("--mask-token", default=None, help="the MASK token: taken if the vocabulary has it, else added "
                                                      "(default: the tokenizer's mask token, else <|mask|>)")
    p.add_argument("--stop-after", choices=STEPS, default="export", help="stop after this step")
    p.add_argument("--device", default="cpu", help="cuda: teacher rows, training and tables on a GPU")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("teacher rows")
    t.add_argument("--teacher-prompts", type=int, default=4000, help="training prompts offered")
    t.add_argument("--teacher-minutes", type=float, default=20,
                   help="time budget for the training rows, in all across runs (more than they took adds a shard)")
    t.add_argument("--teacher-batch", type=int, default=32)
    t.add_argument("--new-tokens", type=int, default=128, help="continuation length (cut after EOS)")
    t.add_argument("--chat-share", type=float, default=0.7, help="share of chat prompts (a model with a template)")
    t.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per set")
    d = p.add_argument_group("distillation")
    d.add_argument("--minutes", type=float, default=60, help="training time in all, across resumed runs")
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--warmup", type=int, default=20)
    d.add_argument("--init", type=Path, default=None, help="start from this drafting LoRA (a PEFT folder, e.g. a "
                                                            "shipped draft_lora/): --rank, --alpha, --targets are its")
    d.add_argument("--rank", type=int, default=16)
    d.add_argument("--alpha", type=float, default=32)
    d.add_argument("--targets", nargs="+", default=None, help="adapted linear layers (default: every linear in the "
                                                               "decoder layers)")
    d.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 8, 16, 16])
    d.add_argument("--draft-tokens", type=int, default=96, help="draft-block tokens per row and step")
    d.add_argument("--kl-weight", type=float, default=1.0)
    d.add_argument("--decay", type=float, default=4.0, help="loss weight exp(-(k-1)/decay) at block place k")
    d.add_argument("--weights", choices=["decay", "confidence"], default="decay",
                   help="loss weights along the block: exp(-(k-1)/decay), or D-PACE's from the drafter's own "
                        "confidence (loop.confidence_weights)")
    d.add_argument("--first-draft", choices=["mask", "verifier"], default="verifier",
                   help="where d_1 comes from (recguide_first_draft, written into the folder's generation config): "
                        "the seed's own causal next-token logits with the base weights (default: it won the "
                        "equal-budget A/B on SmolLM2, docs/distill.md), or the first mask")
    d.add_argument("--eval-minutes", type=float, default=10)
    d.add_argument("--ckpt-minutes", type=float, default=5)
    e = p.add_argument_group("tables and export")
    e.add_argument("--calibrate-prompts", type=int, default=48, help="training-split prompts the value table is "
                                                                     "fitted on")
    e.add_argument("--calibrate-tokens", type=int, default=128, help="new tokens per calibration prompt")
    e.add_argument("--profile-concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    e.add_argument("--profile-block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="the block sizes the cost table prices (and so the policy may choose)")
    e.add_argument("--profile-repeats", type=int, default=5)
    e.add_argument("--block-size", type=int, default=16, help="the folder's default recguide_block_size")
    e.add_argument("--adapter-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="how the drafting LoRA is stored (bf16: half the size; it is upcast when loaded)")
    e.add_argument("--license", default="apache-2.0", help="the model card's license (the base's)")
    e.add_argument("--base-name", default=None, help="the base's name for the model card")
    e.add_argument("--no-weights", action="store_true", help="export without the base weights (a known model's "
                                                             "shipped part: recguide fetch rebuilds the folder)")
    return p


def prepare_base(args, work: Path):
    """Step 1: the frozen base with its MASK token (`WORK/mask.json`; `WORK/base` when the token was added)."""
    from .finish import base_of

    source = base_of(args, work)
    model, tokenizer, added = load_base(source, args.mask_token if source == args.base else None, args.device)
    if added:
        model.save_pretrained(work / "base")
        tokenizer.save_pretrained(work / "base")
    mask = tokenizer.convert_ids_to_tokens(model.config.mask_token_id)
    (work / "mask.json").write_text(json.dumps({"mask_token": mask, "mask_token_id": model.config.mask_token_id,
                                                "added": added or source != args.base}) + "\n")
    print(f"base {args.base}: {type(model).__name__}, MASK = {mask!r} (id {model.config.mask_token_id}"
          f"{', added' if added or source != args.base else ''})", flush=True)
    return model, tokenizer


def run(args) -> int:
    import torch

    from . import finish, loop

    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work or args.out.with_name(args.out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    with (work / "command.txt").open("a") as f:  # every invocation, in order: the card quotes them
        f.write("recguide distill " + " ".join(shlex.quote(str(a)) for a in args.argv) + "\n")
    model, tokenizer = prepare_base(args, work)
    last = STEPS.index(args.stop_after)
    if last >= STEPS.index("teacher"):
        step_teacher(args, model, tokenizer, work)
    if last >= STEPS.index("train"):
        loop.train(args, model, tokenizer, work)
    if last >= STEPS.index("tables"):
        finish.tables(args, model, tokenizer, work)
    if last >= STEPS.index("export"):
        finish.export(args, model, tokenizer, work)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
