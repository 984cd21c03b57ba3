"""Distil a drafter from the FROZEN verifier: a drafting LoRA adapter, or a small AR draft model (docs/algorithm.md §5).

    python training/teacher_data.py --minutes 11 --prompt-len 96 --new-tokens 160 --out data/distill/teacher_v2.npz
    python training/distill.py --student adapter --minutes 60 --run runs/adapter \
        [--init recguide_hf/bundled/recguide-tiny/draft_lora]        # resumes from the committed adapter
    python training/distill.py --student assistant --minutes 60 --run runs/assistant
    python training/distill.py --run runs/adapter --export-to recguide_hf/bundled/recguide-tiny/draft_lora
    python training/distill.py --run runs/assistant --export-to model_cards/recguide-tiny-assistant

Both students learn the same thing from the same data: what the verifier emits. Each step runs the frozen
verifier once, causally and under no_grad, over rows of `[real-text prompt | verifier's greedy continuation]`
(training/teacher_data.py, loops kept). That one pass gives (a) the keys/values every draft block attends to and
(b) the verifier's teacher-forced distribution at every position, whose argmax is exactly the fp32 greedy
token (hard label) and whose probabilities are the soft target.

* `adapter`: K draft blocks per row `[x_t, MASK x (B-1)]` (a quarter of them `[MASK x B]`, the continuation
  branch's shape), anchored inside the continuation, attend to the cached clean keys before t and
  bidirectionally to themselves; the LoRA is on for the block tokens only (as the engine routes it), the base
  weights are frozen. Block sizes are mixed (`--block-sizes`).
* `assistant`: a shallow Qwen3 model (`--assistant-layers` at the verifier's width, embeddings copied from
  the verifier) trained as a next-token model on the same rows: what HF assisted generation needs.

Loss per target: CE to the verifier's argmax + `--kl-weight` x KL(verifier || student), MASK excluded, weighted
exp(-(k-1)/`--decay`) by the target's place k in the block (acceptance is a prefix: k pays only when 1..k-1
did). The assistant uses k = 1 everywhere.

Progress is measured the way acceptance is: on held-out prompts (never HumanEval, never training text) the
verifier's greedy continuation is the draft's target, and a block at anchor t accepts the leading run of
positions where the student's argmax equals it. For both students that run is exactly what LinearSS /
assisted generation would accept starting there, so `tau(B) = 1 + E[min(run, B - 1)]` is measured without
running the decoding loop. `recguide` and `training/measure_model.py` measure the real thing afterwards.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from teacher_data import greedy
from train import TeacherBatches
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from recguide_hf.models.modeling import RecGuideForCausalLM

# the loss, the block sampler and the adapter student are the package's (`recguide distill` trains with them too)
from recguide_hf.tools.distill.loop import (  # noqa: F401  (re-exported for tests)
    AdapterStudent,
    correction_hits,
    decay_weights,
    distill_loss,
    resume,
    run_loop,
    verifier_pass,
)
from recguide_hf.tools.prompts import load_prompts

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class AssistantStudent:
    """A shallow next-token model at the verifier's width, for HF's `assistant_model=` loop."""

    def __init__(self, verifier, args, tokenizer):
        self.mask_id = verifier.config.mask_token_id
        if args.init:
            self.model = Qwen3ForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        else:
            vc = verifier.config
            cfg = Qwen3Config(vocab_size=vc.vocab_size, hidden_size=vc.hidden_size,
                              intermediate_size=vc.intermediate_size, num_hidden_layers=args.assistant_layers,
                              num_attention_heads=vc.num_attention_heads,
                              num_key_value_heads=vc.num_key_value_heads, head_dim=vc.head_dim,
                              max_position_embeddings=vc.max_position_embeddings, rope_parameters=vc.rope_parameters,
                              tie_word_embeddings=True, rms_norm_eps=vc.rms_norm_eps, bos_token_id=vc.bos_token_id,
                              eos_token_id=vc.eos_token_id, pad_token_id=vc.pad_token_id)
            self.model = Qwen3ForCausalLM(cfg)
            with torch.no_grad():  # same tokenizer: start from the verifier's token embeddings
                self.model.model.embed_tokens.weight.copy_(verifier.model.embed_tokens.weight)
        self.tokenizer = tokenizer

    def parameters(self):
        return list(self.model.parameters())

    def loss(self, x, valid, teacher_logp, cache, args, gen, lo):
        logits = self.model(input_ids=x[:, :-1]).logits
        ok = (torch.arange(1, x.shape[1], device=x.device)[None] < valid[:, None]).float()
        ones = torch.ones_like(ok)
        return distill_loss(logits.flatten(0, 1), teacher_logp[:, :-1].flatten(0, 1), ok.flatten(), ones.flatten(),
                            args.kl_weight, self.mask_id)

    @torch.no_grad()
    def runs(self, x, lo, block, stride, teacher_logp, cache):
        drafts = self.model(input_ids=x[:, :-1]).logits
        drafts[..., self.mask_id] = float("-inf")
        hit = (drafts.argmax(-1) == x[:, 1:]).int()  # hit[:, j]: the draft of token j + 1 is right
        anchors = torch.arange(lo, x.shape[1] - block + 1, stride)
        windows = torch.stack([hit[:, a:a + block - 1] for a in anchors.tolist()], 1)  # [N, A, B-1]
        return windows.cumprod(-1).sum(-1)

    def save(self, directory: Path):
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        GenerationConfig(bos_token_id=self.model.config.bos_token_id, eos_token_id=self.model.config.eos_token_id,
                         pad_token_id=self.model.config.pad_token_id).save_pretrained(directory)


# ---------------------------------------------------------------- held-out measurement
@torch.no_grad()
def heldout_rows(verifier, tokenizer, prompt_len: int, new_tokens: int, per_set: int) -> dict[str, torch.Tensor]:
    """The verifier's fp32 greedy continuations of held-out prompts (code: first `per_set`; prose: the last
    `per_set`, away from the prose prompts the model card and the bench measure on)."""
    sets = {"code": load_prompts("code")[:per_set], "prose": load_prompts("prose")[-per_set:]}
    out = {}
    for name, texts in sets.items():
        rows = [ids[-prompt_len:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
                if len(ids) >= prompt_len]
        prompts = torch.tensor(rows)
        out[name] = torch.cat([prompts, greedy(verifier, prompts, new_tokens)], 1)
    return out


@torch.no_grad()
def measure(student, verifier, rows: dict[str, torch.Tensor], prompt_len: int, blocks=(8, 16, 32)) -> dict:
    """Held-out tau(B) by the accepted-run estimate and, for the adapter, the share of blocks whose next block a
    correction branch would supply (`correction_{set}_B{b}`, docs/algorithm.md §2.2's rule with delta 0.5, two
    corrections)."""
    res = {}
    risk = isinstance(student, AdapterStudent)
    for name, x in rows.items():
        cache, logp = verifier_pass(verifier, x, student.mask_id)
        # [N, A] runs capped at max(B) - 1 (and, for the adapter, the correction hits beside them)
        if risk:
            runs, hits = student.runs(x, prompt_len, max(blocks), 4, logp, cache, with_risk=True)
        else:
            runs, hits = student.runs(x, prompt_len, max(blocks), 4, logp, cache), None
        for b in blocks:
            res[f"tau_{name}_B{b}"] = round(1 + runs.clamp(max=b - 1).float().mean().item(), 3)
            if hits is not None:
                res[f"correction_{name}_B{b}"] = round((hits & (runs < b - 1)).float().mean().item(), 3)
        res[f"accept_{name}"] = [round((runs >= k).float().mean().item(), 3) for k in range(1, 9)]
    return res


# ---------------------------------------------------------------- the loop
class PromptRows:
    """TeacherBatches as the shared loop reads teacher rows: `(x, lo, valid)`, every prompt `prompt_len` long."""

    def __init__(self, batches: TeacherBatches):
        self.batches = batches

    def next(self):
        x, valid = self.batches.next()
        return x, self.batches.prompt_len, valid


def train(args):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.verifier)
    verifier = RecGuideForCausalLM.from_pretrained(args.verifier, dtype=torch.float32, draft_adapter=False)
    verifier.to(device).eval()
    for p in verifier.parameters():
        p.requires_grad_(False)
    if args.student == "adapter":
        student = AdapterStudent(verifier, args)
    else:
        student = AssistantStudent(verifier, args, tokenizer)
        student.model.to(device)
    params = student.parameters()
    num_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = TeacherBatches(args.teacher_data, args.batch_size, args.seed)
    held = {k: v.to(device) for k, v in heldout_rows(verifier, tokenizer, 96, 128, args.eval_prompts).items()}
    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "log": [], "previous_minutes": args.previous_minutes,
             "sessions": []}
    earlier = args.init / "distill_log.json" if args.init else None
    if earlier is not None and earlier.exists():  # continue the curve and keep what each earlier session did
        prev = json.loads(earlier.read_text())
        state["log"] = list(prev["log"])
        state["sessions"] = prev.get("sessions", []) + [
            {k: prev.get(k) for k in ("args", "step", "elapsed", "tokens", "teacher_data")}]
    ckpt = args.run / "ckpt.pt"
    if args.resume and ckpt.exists():
        state = resume(params, opt, torch.load(ckpt, weights_only=False), state)
    if args.moments_from is not None and not (args.resume and ckpt.exists()):
        # AdamW's moments from the run that made --init: a warm restart then starts with calibrated step sizes
        blob = torch.load(args.moments_from, weights_only=False)
        same = len(blob["params"]) == len(params) and all(
            torch.equal(p.detach().cpu(), saved) for p, saved in zip(params, blob["params"]))
        if not same:
            raise ValueError(f"{args.moments_from} was not saved with the parameters in --init {args.init}")
        opt.load_state_dict(blob["opt"])
    print(f"{args.student}: {num_params / 1e6:.2f}M trainable parameters, budget {args.minutes} min, "
          f"{len(batches.tokens)} teacher rows", flush=True)
    run_loop(student, verifier, PromptRows(batches), opt, state, args, args.run,
             lambda: measure(student, verifier, held, 96), desc=args.student)
    reports = [json.loads(t.read_text()) for t in (d.with_suffix(".json") for d in args.teacher_data) if t.exists()]
    logged = {k: " ".join(map(str, v)) if k == "teacher_data" else str(v) for k, v in vars(args).items()}
    (args.run / "final" / "distill_log.json").write_text(json.dumps(
        {"args": logged, "trainable_parameters": num_params, "teacher_data": reports or None, **state}, indent=1))


def export(run: Path, to: Path, teacher_data: list[Path]):
    """Copy a run's final student (adapter or model folder) and its log to `to`, with the teacher-data report."""
    import shutil

    to.mkdir(parents=True, exist_ok=True)
    for f in (run / "final").iterdir():
        shutil.copy2(f, to / f.name)
    log = json.loads((to / "distill_log.json").read_text())
    logged = log["args"].get("teacher_data")  # the run's own files (space-separated), else the command line's
    reports = [p.with_suffix(".json") for p in (map(Path, logged.split()) if logged else teacher_data)]
    if not log.get("teacher_data") and all(r.exists() for r in reports):
        log["teacher_data"] = [json.loads(r.read_text()) for r in reports]
        (to / "distill_log.json").write_text(json.dumps(log, indent=1))
    print(f"exported {run / 'final'} -> {to}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", choices=["adapter", "assistant"], default="adapter")
    p.add_argument("--verifier", type=Path, default=Path("recguide_hf/bundled/recguide-tiny"))
    p.add_argument("--teacher-data", type=Path, nargs="+", default=[Path("data/distill/teacher_v2.npz")],
                   help="one or more training/teacher_data.py files (same prompt and row lengths); rows are pooled")
    p.add_argument("--init", type=Path, default=None, help="continue from this adapter / assistant folder")
    p.add_argument("--previous-minutes", type=float, default=0.0, help="training minutes already in --init")
    p.add_argument("--run", type=Path, default=Path("runs/adapter"))
    p.add_argument("--resume", action="store_true", help="continue the optimizer state in RUN/ckpt.pt")
    p.add_argument("--moments-from", type=Path, default=None,
                   help="a ckpt.pt whose parameters equal --init's: start AdamW from its moments (a warm restart)")
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64)
    p.add_argument("--targets", nargs="+", default=ALL_LINEARS)
    p.add_argument("--assistant-layers", type=int, default=2)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16, 16, 32])
    p.add_argument("--draft-tokens", type=int, default=128, help="draft-block tokens per row and step")
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--rank2-weight", type=float, default=0.0,
                   help="weight of the correction-branch term: where the student's argmax is wrong, CE of the "
                        "teacher's token with that argmax (and MASK, EOS) removed, so c_p is the verifier's token")
    p.add_argument("--decay", type=float, default=4.0, help="loss weight exp(-(k-1)/decay) at block place k")
    p.add_argument("--first-draft", choices=["mask", "verifier"], default="mask",
                   help="the engine layout the adapter drafts in (recguide_first_draft): with 'verifier' the seed "
                        "is causal and adapter-free, d_1 is its prediction, and the loss starts at place 2")
    p.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts per set for the tau curve")
    p.add_argument("--eval-minutes", type=float, default=10)
    p.add_argument("--ckpt-minutes", type=float, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--export-to", type=Path, default=None, help="copy RUN/final there instead of training")
    args = p.parse_args(argv)
    if args.export_to:
        export(args.run, args.export_to, args.teacher_data)
    else:
        train(args)


if __name__ == "__main__":
    main()
