"""Distilling a drafting adapter from its frozen verifier: the maths and the training loop (docs/algorithm.md §5).

Each step runs the frozen verifier once, causally and under no_grad, over teacher rows `[prompt | the verifier's
greedy continuation]` (teacher.py). That one pass gives (a) the keys/values every draft block attends to and (b) the
verifier's teacher-forced distribution at every position, whose argmax is exactly the fp32 greedy token (hard label)
and whose probabilities are the soft target. K draft blocks per row `[x_t, MASK x (B-1)]` (a quarter `[MASK x B]`,
the continuation branch's shape), anchored inside the continuation, attend to the cached clean keys before t and
bidirectionally to themselves; the LoRA is on for the block tokens only (as the engine routes it).

Loss per target: CE to the verifier's argmax + `kl_weight` x KL(verifier || student), MASK excluded, weighted
exp(-(k-1)/`decay`) by the target's place k in the block (acceptance is a prefix: k pays only when 1..k-1 did),
or by the drafter's own confidence (`confidence_weights`, D-PACE).

Progress is measured by decoding: `measure.engine_taus` runs LinearSS through the engine on held-out prompts (and as
many training prompts) and counts tokens per round; the draft forward trained here is the engine's own layout
(`block_layout` + `seed_layout` + the adapter's routing; tests/test_distill.py compares the two forwards).

`recguide distill` (make.py) and the bundled model's scripts (training/distill.py, training/train.py) share this
module: one copy of the loss, the block sampler, the student and the loop.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from ...core.draft import make_draft
from ...core.masks import additive_mask
from ...models.compat import CACHE_KW
from ...models.draft_adapter import add_draft_adapter, attach_draft_adapter, route, save_draft_adapter
from .teacher import TeacherRows, shards_info, stop_ids, train_shards


# ---------------------------------------------------------------- draft blocks and the loss
def block_layout(x: torch.Tensor, starts: torch.Tensor, block_size: int, mask_id: int,
                 no_seed: torch.Tensor | None = None):
    """Draft blocks at anchors `starts` [N, K] over clean rows x [N, L], laid out as the engine's draft forward lays
    a round out: block k is `[x_t, MASK x (B-1)]` (where `no_seed` [N, K, 1] is set: `[MASK x B]`, the continuation
    branch's shape) at positions t .. t+B-1, seeing the clean keys before t and its own block bidirectionally.
    Returns input ids and position ids [N, K*B], the clean tokens at the block's places [N, K, B] and the boolean
    attention pattern [N, 1, K*B, L + K*B]. Training, the held-out measurement and the layout test use it."""
    n, length = x.shape
    k, b = starts.shape[1], block_size
    offs = torch.arange(b, device=x.device)
    pos = starts[:, :, None] + offs  # [N, K, B]
    targets = torch.gather(x, 1, pos.clamp(max=length - 1).view(n, -1)).view(n, k, b)
    masked = (offs > 0) if no_seed is None else (offs > 0) | no_seed
    inputs = torch.where(masked, torch.full_like(targets, mask_id), targets)
    # attention: clean keys j < t, plus own block (bidirectional)
    col = torch.arange(length, device=x.device)
    sees_clean = col[None, None, :] < starts[:, :, None]  # [N, K, L]
    sees_clean = sees_clean[:, :, None, :].expand(n, k, b, length).reshape(n, k * b, length)
    blk = torch.arange(k, device=x.device).repeat_interleave(b)
    sees_block = (blk[:, None] == blk[None, :]).expand(n, k * b, k * b)
    allowed = torch.cat([sees_clean, sees_block], dim=-1)[:, None]  # [N, 1, K*B, L+K*B]
    return inputs.view(n, -1), pos.view(n, -1), targets, allowed


def draft_blocks(x: torch.Tensor, block_size: int, num_blocks: int, mask_id: int, gen: torch.Generator,
                 lo: int = 1, valid: torch.Tensor | None = None):
    """Sample draft blocks over clean sequences x [N, L] (`block_layout` at random anchors).

    Anchors t lie in [lo, L - B] (or, with `valid` [N], in [lo, valid - 2] with targets at or past `valid`
    not trained; `lo` may then be per row, [N]); a quarter of the blocks are continuation-shaped.
    Returns block input ids, position ids, targets (-100 where not trained), per-position loss
    weights (all [N, K*B]) and the boolean attention pattern [N, 1, K*B, L + K*B].
    """
    n, length = x.shape
    k, b = num_blocks, block_size
    offs = torch.arange(b)
    if valid is None:  # anchors t in [lo, L - B]; the block covers positions t .. t+B-1
        starts = torch.stack([torch.randperm(length - b - lo + 1, generator=gen)[:k] + lo for _ in range(n)])
        limit = torch.full((n,), length)
    else:  # `lo` an int or, for rows whose prompts differ in length, [N]
        lo = torch.as_tensor(lo).view(-1, 1)
        span = (valid[:, None] - 1 - lo).clamp(min=1)
        starts = lo + (torch.rand(n, k, generator=gen) * span).long()  # [N, K]
        limit = valid
    no_seed = torch.rand(n, k, 1, generator=gen) < 0.25  # continuation-shaped blocks: [MASK x B]
    inputs, pos, targets, allowed = block_layout(x, starts, b, mask_id, no_seed)
    masked = ((offs > 0) | no_seed) & (pos.view(n, k, b) < limit[:, None, None])  # [N, K, B]
    labels = torch.where(masked, targets, torch.full_like(targets, -100))
    weights = (1.0 / torch.sqrt(offs.clamp(min=1).float())).expand(n, k, b) * masked
    return inputs, pos, labels.view(n, -1), weights.view(n, -1), allowed



def set_lr(opt, base_lr: float, step: int, warmup: int, frac: float):
    """Linear warm-up over `warmup` steps, then cosine from base_lr to base_lr / 10 over the time budget."""
    warm = min(1.0, (step + 1) / warmup)
    for group in opt.param_groups:
        group["lr"] = base_lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))



@torch.no_grad()
def verifier_pass(verifier, x: torch.Tensor, mask_id: int):
    """Cache of the clean rows x [N, L] and the verifier's log-probs at every position [N, L, V] (MASK -inf)."""
    cache = DynamicCache(config=verifier.config)
    logits = verifier(input_ids=x, use_cache=True, **{CACHE_KW: cache}).logits.float()
    logits[..., mask_id] = float("-inf")
    return cache, logits.log_softmax(-1)




def distill_loss(student_logits, teacher_logp, labels_ok, weights, kl_weight: float, mask_id: int,
                 rank2_weight: float = 0.0, excluded: list[int] | None = None):
    """Weighted CE to the teacher's argmax + KL(teacher || student) [+ the rank-2 term]. All [T, V] / [T].

    The rank-2 term is what a correction branch needs (docs/algorithm.md §2.2): where the student's argmax is wrong, the
    branch hypothesises the second-ranked token c_p (never MASK, EOS or the argmax), so the teacher's token is
    trained to be the argmax of the student's distribution with its own argmax (and `excluded`) removed. It
    leaves the argmax's own logit alone, so it cannot make a right first choice wrong.
    """
    student_logits = student_logits.float()
    student_logits[:, mask_id] = float("-inf")
    logq = student_logits.log_softmax(-1)
    target = teacher_logp.argmax(-1)
    ce = F.nll_loss(logq, target, reduction="none")
    p = teacher_logp.exp()
    kl = (p * (teacher_logp - logq.clamp(min=-1e4))).nan_to_num().sum(-1)
    per_token = ce + kl_weight * kl
    if rank2_weight:
        top = student_logits.detach().argmax(-1)
        wrong = (top != target).float()
        others = student_logits.scatter(1, top[:, None], float("-inf"))
        if excluded:
            others[:, excluded] = float("-inf")
        r2 = F.cross_entropy(others, target, reduction="none").nan_to_num(posinf=0.0)  # EOS targets: not trainable
        per_token = per_token + rank2_weight * wrong * r2
    w = weights * labels_ok
    return (per_token * w).sum() / w.sum().clamp(min=1e-6), ce.detach()[labels_ok > 0].mean()




def decay_weights(block_pos: torch.Tensor, decay: float, first: int = 1) -> torch.Tensor:
    """exp(-(k - first) / decay) at block place k >= first, 0 before it (place 0: the seed, or, in a
    continuation-shaped block, a mask weighted like place 1)."""
    k = block_pos.clamp(min=1)
    return torch.where(k >= first, torch.exp(-(k - first).float() / decay), torch.zeros_like(k, dtype=torch.float))




def confidence_weights(q: torch.Tensor, trained: torch.Tensor, block: int) -> torch.Tensor:
    """D-PACE's loss weights (arXiv 2605.18810) from the drafter's own confidence, detached: at block place k,
    `w_k = sum_{m>=k} prod_{j<=m} (0.5 + 0.5 q_j)`, q_j the student's probability of the verifier's token at place j
    (a place that is not trained counts as certain, q = 1: a seed, or d_1 taken from the verifier). A place weighs
    what every later place's acceptance depends on it, as far as the places before it are likely right.
    q, trained: [N, K*B] (blocks of `block` consecutive places); returns [N, K*B], 0 where not trained."""
    n = q.shape[0]
    q = torch.where(trained, q, torch.ones_like(q)).view(n, -1, block)
    reach = torch.cumprod(0.5 + 0.5 * q, -1)  # prod_{j<=m}
    w = reach.flip(-1).cumsum(-1).flip(-1)  # sum_{m>=k}
    return (w.view(n, -1) * trained).detach()


def seed_layout(ids: torch.Tensor, allowed: torch.Tensor, mask_id: int, first_draft: str):
    """Which block tokens draft (the adapter's per-token mask) and what they see, as the engine's draft forward
    runs them: with `first_draft="mask"` every block token is a draft token; with "verifier" a block's seed
    (its clean first token) sees only the clean prefix and itself, with the base weights, so its logits are
    the verifier's own next-token prediction (d_1), and only the mask tokens draft."""
    if first_draft == "mask":
        return 0, allowed  # every token (route's int form)
    seed = ids != mask_id  # [N, Q]; continuation-shaped blocks ([MASK x B]) have none
    q = ids.shape[1]
    allowed = allowed.clone()
    allowed[:, 0, :, -q:] &= ~seed[:, :, None] | torch.eye(q, dtype=torch.bool, device=ids.device)
    return ~seed, allowed




def correction_hits(margin, correction, targets, runs, delta: float = 0.5, max_corrections: int = 2):
    """Would a correction branch supply the next block? margin, correction, targets: [N, A, B-1]; runs [N, A].

    The rule of docs/algorithm.md §2.2, per block: the first mismatch sits at draft place `runs` (0-based; none when
    the whole block was accepted); a correction at p hits iff p is among the earliest `max_corrections` risky places
    (margin < delta) and the verifier's token there equals the correction token c_p. Returns `(hit, place)`:
    Returns hit [N, A] bool for the whole block; at block size b the branch exists only if the mismatch
    falls inside the block: `hit & (runs < b - 1)` (truncating the block leaves the earlier places as they are).
    """
    k = margin.shape[-1]
    risky = margin < delta
    earlier = torch.cumsum(risky.int(), -1) - risky.int()  # risky places before each place
    at = runs.clamp(max=k - 1)[..., None]
    mismatch = runs < k
    first_ok = (risky & (earlier < max_corrections)).gather(-1, at).squeeze(-1)
    right = (correction.gather(-1, at) == targets.gather(-1, at)).squeeze(-1)
    return mismatch & first_ok & right




class AdapterStudent:
    """The verifier plus a LoRA that only draft-block tokens see."""

    def __init__(self, verifier, args):
        self.model = verifier
        if getattr(args, "init", None):
            self.adapter = attach_draft_adapter(verifier, args.init)
            self.adapter.requires_grad_(True)
        else:
            self.adapter = add_draft_adapter(verifier, args.rank, args.alpha, args.targets or linear_names(verifier))
        self.mask_id = verifier.config.mask_token_id
        eos = verifier.config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.first_draft = getattr(args, "first_draft", "mask")

    @classmethod
    def attached(cls, model, first_draft: str = "mask"):
        """A student over a model whose drafting adapter is already attached (to measure a shipped adapter)."""
        self = cls.__new__(cls)
        self.model, self.adapter, self.first_draft = model, model.draft_adapter, first_draft
        self.mask_id = model.config.mask_token_id
        eos = model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return self

    def parameters(self):
        return list(self.adapter.parameters())

    def block_logits(self, cache, x, valid, lo, block, num_blocks, gen):
        lo = lo.cpu() if torch.is_tensor(lo) else lo
        ids, pos, labels, _, allowed = draft_blocks(x.cpu(), block, num_blocks, self.mask_id, gen, lo=lo,
                                                    valid=valid.cpu())
        dev = x.device
        draft_mask, allowed = seed_layout(ids, allowed, self.mask_id, self.first_draft)
        with route(self.adapter, draft_mask if isinstance(draft_mask, int) else draft_mask.to(dev)):
            logits = self.model(input_ids=ids.to(dev), position_ids=pos.to(dev),
                                attention_mask=additive_mask(allowed.to(dev)), use_cache=True,
                                **{CACHE_KW: cache}).logits
        cache.crop(-ids.shape[1])  # drop the block keys: the clean prefix is all later passes may see
        block_pos = torch.arange(block).repeat(num_blocks).expand_as(pos)
        seeded = (ids.view(ids.shape[0], num_blocks, block)[:, :, :1] != self.mask_id).expand(-1, -1, block)
        return (logits, pos.to(dev), (labels != -100).float().to(dev), block_pos.to(dev),
                seeded.reshape(ids.shape).to(dev))

    def loss(self, x, valid, teacher_logp, cache, args, gen, lo):
        block = random.choice(args.block_sizes)
        k = max(1, args.draft_tokens // block)
        logits, pos, ok, block_pos, seeded = self.block_logits(cache, x, valid, lo, block, k, gen)
        # the block token at position j is predicted by the verifier's logits at j - 1
        src = (pos - 1).clamp(max=x.shape[1] - 1)  # targets past the row are not trained (ok = 0)
        t_logp = torch.gather(teacher_logp, 1, src[..., None].expand(-1, -1, teacher_logp.shape[-1]))
        weights = decay_weights(block_pos, args.decay)
        if self.first_draft == "verifier":  # d_1 is the seed's (exact); acceptance is first at risk at place 2
            weights = torch.where(seeded, decay_weights(block_pos, args.decay, first=2), weights)
        if getattr(args, "weights", "decay") == "confidence":
            target = t_logp.argmax(-1, keepdim=True)
            q = logits.detach().float().log_softmax(-1).gather(-1, target).squeeze(-1).exp()
            weights = confidence_weights(q, (weights > 0) & (ok > 0), block)
        return distill_loss(logits.flatten(0, 1), t_logp.flatten(0, 1), ok.flatten(), weights.flatten(),
                            args.kl_weight, self.mask_id, getattr(args, "rank2_weight", 0.0), self.eos_ids)

    @torch.no_grad()
    def runs(self, x, lo, block, stride, teacher_logp, cache, with_risk: bool = False):
        """Accepted-run length of a draft block at every `stride`-th anchor t in [lo, L - block]: [N, A];
        with `with_risk`, also whether a correction branch would supply the next block there (`correction_hits`)."""
        n, length = x.shape
        dev = x.device
        anchors = torch.arange(lo, length - block + 1, stride, device=dev)
        a = len(anchors)
        offs = torch.arange(block, device=dev)
        ids, pos, _, allowed = block_layout(x, anchors.expand(n, a), block, self.mask_id)
        draft_mask, allowed = seed_layout(ids, allowed, self.mask_id, self.first_draft)
        with route(self.adapter, draft_mask):
            logits = self.model(input_ids=ids, position_ids=pos, attention_mask=additive_mask(allowed),
                                use_cache=True, **{CACHE_KW: cache}).logits
        cache.crop(-a * block)
        logits[..., self.mask_id] = float("-inf")
        logits = logits.view(n, a, block, -1)
        # d_1 from the first mask, or (first_draft="verifier") from the seed itself; d_2 .. from the masks
        logits = torch.cat([logits[:, :, :1], logits[:, :, 2:]] if self.first_draft == "verifier"
                           else [logits[:, :, 1:]], 2)  # [N, A, B-1, V]
        drafts = logits.argmax(-1)
        targets = x[:, anchors[:, None] + offs[1:]]  # [N, A, B-1]: the verifier's greedy tokens
        runs = (drafts == targets).int().cumprod(-1).sum(-1)
        if not with_risk:
            return runs
        block_ = make_draft(logits.flatten(0, 1), self.mask_id, self.eos_ids)
        return runs, correction_hits(block_.margin.view(n, a, -1), block_.correction.view(n, a, -1), targets, runs)

    def save(self, directory: Path):
        save_draft_adapter(self.model, directory)




# ---------------------------------------------------------------- held-out measurement
MEASURED_BLOCKS = (4, 8, 16)  # the block sizes `recguide distill` logs tau at (LinearSS through the engine)


def linear_names(model) -> list[str]:
    """The names of every Linear inside the decoder layers (q/k/v/o and the MLP's, for the usual families)."""
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    return sorted({n.rsplit(".", 1)[-1] for n, m in layers.named_modules() if isinstance(m, torch.nn.Linear)})


@torch.no_grad()
def heldout_taus(student, verifier, x, lo, valid, blocks=(4, 8, 16), stride: int = 4, chunk: int = 4) -> dict:
    """The accepted-run ESTIMATE `recguide distill` logged before it measured by decoding (`measure.engine_taus`),
    kept to show how far it reads from decoding (eval/engine_tau.py; `measure` explains why it reads high).
    tau(B) on held-out teacher rows x [N, L] (prompt lengths `lo`, row lengths `valid`, both [N]): the mean over
    every `stride`-th anchor t of each row's continuation with a whole max(B)-block inside it of 1 + min(run, B - 1),
    and `accept`: the share of anchors whose run reaches k, k = 1..8."""
    big = max(blocks)
    runs_all = []
    for i in range(0, len(x), chunk):
        xs, los, vs = x[i:i + chunk], lo[i:i + chunk], valid[i:i + chunk]
        xs = xs[:, :int(vs.max())]
        cache = DynamicCache(config=verifier.config)
        verifier(input_ids=xs, use_cache=True, logits_to_keep=1, **{CACHE_KW: cache})
        start = int(los.min())
        anchors = torch.arange(start, xs.shape[1] - big + 1, stride, device=xs.device)
        if not len(anchors):  # no continuation here holds a whole block
            continue
        runs = student.runs(xs, start, big, stride, None, cache)  # [n, A] over anchors start, start + stride, ...
        ok = (anchors[None] >= los[:, None]) & (anchors[None] + big <= vs[:, None])
        runs_all.append(runs[ok].cpu())
    runs = torch.cat(runs_all) if runs_all else torch.zeros(0, dtype=torch.long)
    if not len(runs):
        return {**{f"tau_B{b}": None for b in blocks}, "accept": None, "anchors": 0}
    res = {f"tau_B{b}": round(1 + runs.clamp(max=b - 1).float().mean().item(), 3) for b in blocks}
    res["accept"] = [round((runs >= k).float().mean().item(), 3) for k in range(1, 9)]
    res["anchors"] = len(runs)
    return res


def load_rows(path: Path):
    blob = np.load(path)
    return tuple(torch.from_numpy(blob[k].astype(np.int64)) for k in ("tokens", "lo", "valid"))


# ---------------------------------------------------------------- the loop
def run_loop(student, verifier, batches, opt, state: dict, args, run: Path, measure, desc: str = "distill") -> None:
    """Train `student` until `state["elapsed"]` reaches `args.minutes` (minutes in all, across resumed runs): each step
    one verifier pass over a batch of teacher rows `(x, lo, valid)` and the student's loss; a checkpoint every
    `args.ckpt_minutes`, `measure()` (-> metrics) logged every `args.eval_minutes` and at the end. `state` holds the
    step, the training seconds and CPU seconds (measuring excluded), the target tokens and the log; it is saved in
    the checkpoint, so a later call continues the schedule and the curve. Both `recguide distill` and the bundled
    model's training/distill.py train with it."""
    params = student.parameters()
    device = next(verifier.parameters()).device
    gen = torch.Generator().manual_seed(args.seed + state["step"])
    budget = args.minutes * 60
    state.setdefault("cpu_seconds", 0.0)

    def record(parts=None):
        entry = {"step": state["step"], "minutes": round(state["elapsed"] / 60 + state.get("previous_minutes", 0), 2),
                 "cpu_hours": round(state["cpu_seconds"] / 3600, 3), "target_tokens": state["tokens"],
                 **(parts or {}), **measure()}
        state["log"].append(entry)
        print(json.dumps(entry), flush=True)

    if state["step"] == 0:  # where this run starts (a continued adapter: re-measured)
        record()
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), unit="s", desc=desc, mininterval=10)
    last_ckpt = last_eval = time.time()
    t0, c0 = time.time() - state["elapsed"], time.process_time() - state["cpu_seconds"]
    loss = ce = torch.zeros(())
    while state["elapsed"] < budget:
        set_lr(opt, args.lr, state["step"], args.warmup, state["elapsed"] / budget)
        x, lo, valid = batches.next()
        x, valid = x.to(device), valid.to(device)
        cache, teacher_logp = verifier_pass(verifier, x, student.mask_id)
        loss, ce = student.loss(x, valid, teacher_logp, cache, args, gen, lo)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += int((valid.cpu() - lo).sum())
        state["elapsed"], state["cpu_seconds"] = time.time() - t0, time.process_time() - c0
        bar.update(int(state["elapsed"]) - bar.n)
        if state["step"] % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", ce=f"{ce.item():.3f}")
        if time.time() - last_eval > args.eval_minutes * 60:  # measuring is not training: its time is not counted
            w, c = time.time(), time.process_time()
            record({"loss": round(loss.item(), 4), "ce": round(ce.item(), 4)})
            last_eval = time.time()
            t0, c0 = t0 + last_eval - w, c0 + time.process_time() - c
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save(student, opt, params, state, run)
            last_ckpt = time.time()
    bar.close()
    record({"loss": round(loss.item(), 4), "ce": round(ce.item(), 4)})
    save(student, opt, params, state, run)


def resume(params, opt, blob: dict | None, state: dict) -> dict:
    """A checkpoint's (`torch.load` of a `save`d ckpt.pt) parameters and optimizer moments into `params` / `opt`;
    returns its state (without a checkpoint: `state`)."""
    if blob is None:
        return state
    if [tuple(p.shape) for p in params] != [tuple(t.shape) for t in blob["params"]]:
        raise ValueError("the checkpoint's adapter has other parameters than this run's: resume with the --init "
                         "(or --rank, --alpha, --targets) the run was started with (its work folder's command.txt)")
    for p, saved in zip(params, blob["params"]):
        p.data.copy_(saved)
    opt.load_state_dict(blob["opt"])
    return blob["state"]


def train(args, verifier, tokenizer, work: Path) -> Path:
    """`recguide distill`'s training step: a drafting adapter into `work/run/final`, resuming `work/run/ckpt.pt`
    when there is one, until `args.minutes` of training have passed in all; returns the final adapter folder."""
    from .measure import engine_taus, rows_as_prompts

    run = work / "run"
    ckpt = run / "ckpt.pt"
    blob = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    if blob is not None:
        if blob["state"]["elapsed"] >= args.minutes * 60:
            print(f"training: {blob['state']['elapsed'] / 60:.1f} of {args.minutes} minutes done", flush=True)
            if not (run / "final" / "distill_log.json").exists():  # stopped between the checkpoint and the log
                write_log(args, work, blob["state"], sum(p.numel() for p in blob["params"]))
            return run / "final"
    torch.manual_seed(args.seed)
    student = AdapterStudent(verifier, args)
    params = student.parameters()
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = TeacherRows(train_shards(work / "teacher"), args.batch_size, args.seed)
    # decoding's own figures on held-out prompts (and on as many training rows, to show overfitting): the engine's
    # rounds, whose output must equal the rows' greedy continuations
    # (`--eval-prompts` of each: the held-out files may hold more, made by a run that asked for more)
    held = {p.stem.removeprefix("heldout_"): rows_as_prompts(*(t[:args.eval_prompts] for t in load_rows(p)))
            for p in sorted((work / "teacher").glob("heldout_*.npz"))}
    held["train"] = rows_as_prompts(*(t[:args.eval_prompts] for t in load_rows(work / "teacher" / "train.npz")))
    eos_ids, pad_id = stop_ids(verifier, tokenizer)
    state = resume(params, opt, blob, {"step": 0, "elapsed": 0.0, "cpu_seconds": 0.0, "tokens": 0, "log": [],
                                       "runs": 0})
    if state["step"]:
        print(f"resuming at step {state['step']} ({state['elapsed'] / 60:.1f} min)", flush=True)
    state["runs"] = state.get("runs", 0) + 1
    random.seed(args.seed + state["step"])  # a resumed run draws on from its step, not the first steps' draws again
    batches.rng = np.random.default_rng(args.seed + state["step"])

    def measure():
        out = {}
        for name, (prompts, conts) in held.items():
            res = engine_taus(verifier, prompts, MEASURED_BLOCKS, args.new_tokens, student.first_draft, batch=32,
                              pad_token_id=pad_id, eos_token_ids=eos_ids, references=conts)
            out.update({f"{k}_{name}": res[k] for k in res if k.split("_")[0] in ("tau", "tpf", "accept", "equal")})
        return out

    num_params = sum(p.numel() for p in params)
    print(f"adapter: {num_params / 1e6:.2f}M trainable parameters on {student.adapter.target_modules}, budget "
          f"{args.minutes} min, {len(batches)} teacher rows", flush=True)
    run_loop(student, verifier, batches, opt, state, args, run, measure)
    write_log(args, work, state, num_params)
    return run / "final"


def write_log(args, work: Path, state: dict, num_params: int) -> None:
    """`run/final/distill_log.json`: the settings, the teacher rows' report and the state with its tau curve."""
    logged = {k: str(v) for k, v in vars(args).items() if not callable(v) and k not in ("cli_argv", "command_line")}
    (work / "run" / "final" / "distill_log.json").write_text(json.dumps(
        {"args": logged, "trainable_parameters": num_params,
         "teacher_rows": shards_info(work / "teacher"), **state}, indent=1))


def save(student, opt, params, state, run: Path):
    run.mkdir(parents=True, exist_ok=True)
    student.save(run / "final")
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict(), "state": state},
               run / "ckpt.pt.tmp")
    os.replace(run / "ckpt.pt.tmp", run / "ckpt.pt")
