"""What decoding sees: tau, TPF and the acceptance profile of the engine's own rounds (docs/distill.md).

A drafter is measured by decoding with it: `engine_taus` runs LinearSS at fixed block sizes through the engine on a
set of prompts and reads the round log. `recguide distill` logs it on its held-out prompts, the model card quotes it,
and `eval/engine_tau.py` reports it beside the accepted-run estimate it replaced.

Why the estimate was wrong (2.86 against 1.9 on SmolLM2): it averaged `1 + min(run, B - 1)` over anchors spread
evenly along each greedy continuation. Decoding does not visit positions evenly: a round starts where the last one
stopped, so an easy stretch (long runs) is crossed in few rounds and a hard stretch is visited by many short ones.
Tokens per round is total tokens / rounds, a mean over rounds, not over positions; weighting every position alike
counts the easy stretches once per position they cover. `path_tau` replays decoding's own path over the same
teacher-forced runs (a round at t, the next at t + n + 1) and agrees with the engine; `every_anchor_tau` is the old
estimate, kept for that comparison only.
"""

from __future__ import annotations

import torch

from ...core.config import DecodingConfig
from ...core.engine import Engine, SamplingSettings
from ...core.masks import left_pad
from ...models.registry import as_backbone

PROFILE_PLACES = 8  # the acceptance profile: P(first k drafts accepted), k = 1..8


@torch.no_grad()
def engine_taus(model, prompts: list[list[int]], blocks=(4, 8, 16), max_new_tokens: int = 128,
                first_draft: str = "mask", batch: int = 16, pad_token_id: int = 0, eos_token_ids=(),
                references: list[list[int]] | None = None) -> dict:
    """LinearSS greedy decoding of `prompts` (token-id lists) at each fixed block size B.

    Returns, per B: `tau_B{B}` (new tokens / rounds), `tpf_B{B}` (new tokens / forwards a request took part in) and
    `accept_B{B}` (the share of full-size rounds whose first k drafts were accepted, k = 1..8); `rounds`; with
    `references` (each prompt's greedy continuation, cut after its EOS), `equal`: whether every output equals it.
    """
    backbone = as_backbone(model)
    settings = SamplingSettings(max_new_tokens=max_new_tokens, eos_token_ids=list(eos_token_ids),
                                pad_token_id=pad_token_id)
    out: dict = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "first_draft": first_draft}
    equal = True
    for block in blocks:
        config = DecodingConfig(mode="linear", block_size=block, first_draft=first_draft)
        new = rounds = forwards = 0
        runs: list[int] = []
        for i in range(0, len(prompts), batch):
            ids, attn = left_pad(prompts[i:i + batch], pad_token_id)
            seqs, stats = Engine(backbone, config, settings).generate(ids, attn, log_rounds=True)
            new += int(stats.new_tokens.sum())
            rounds += int(stats.rounds.sum())
            forwards += int(stats.forwards.sum())
            runs += [n for _, b, n, k, _, _ in stats.round_log if k == b - 1]  # full-size rounds only
            if references is not None:
                for r, ref in enumerate(references[i:i + batch]):
                    got = seqs[r, ids.shape[1]:ids.shape[1] + int(stats.new_tokens[r])].tolist()
                    equal &= got == ref[:max_new_tokens]
        full = torch.tensor(runs, dtype=torch.float)
        out[f"tau_B{block}"] = round(new / rounds, 3) if rounds else None
        out[f"tpf_B{block}"] = round(new / forwards, 3) if forwards else None
        out[f"accept_B{block}"] = [round((full >= k).float().mean().item(), 3) if len(full) else None
                                   for k in range(1, min(block - 1, PROFILE_PLACES) + 1)]
        out[f"rounds_B{block}"] = rounds
    if references is not None:
        out["equal"] = equal
    return out


def rows_as_prompts(x: torch.Tensor, lo: torch.Tensor, valid: torch.Tensor) -> tuple[list, list]:
    """Teacher rows `[prompt | greedy continuation]` (x [N, L], prompt lengths lo [N], row lengths valid [N]) as
    (prompts, continuations): what `engine_taus` decodes and what its output must equal."""
    prompts = [x[i, :int(lo[i])].tolist() for i in range(len(x))]
    conts = [x[i, int(lo[i]):int(valid[i])].tolist() for i in range(len(x))]
    return prompts, conts


def path_tau(runs: list[int], start: int, end: int, block: int) -> tuple[int, int]:
    """Decoding's path over teacher-forced accepted runs: `runs[j]` is the run of a block seeded at position
    `start + j`; the first round is seeded at `start` (the prompt's last token), a round at t emits
    n + 1 = min(run, eff - 1) + 1 tokens with eff = min(B, tokens left), and the next round is seeded at t + n + 1,
    until position `end - 1` (the row's last token) is produced. Returns (tokens, rounds)."""
    t, tokens, rounds = start, 0, 0
    while t < end - 1:
        eff = min(block, end - 1 - t)
        n = min(runs[t - start], eff - 1)
        tokens, rounds, t = tokens + n + 1, rounds + 1, t + n + 1
    return tokens, rounds


def every_anchor_tau(runs: list[int], block: int) -> float:
    """The old estimate: 1 + min(run, B - 1) averaged over anchors regardless of decoding's path."""
    return 1 + sum(min(r, block - 1) for r in runs) / len(runs)


@torch.no_grad()
def anchor_runs(student, x: torch.Tensor, lo: torch.Tensor, valid: torch.Tensor, block: int,
                chunk: int = 1) -> list[list[int]]:
    """Teacher-forced accepted runs of a B-block seeded at every position a round of decoding may start from: for
    row i, positions lo_i - 1 (the prompt's last token, the first round's seed) .. valid_i - 2. `student` is a
    `loop.AdapterStudent` over the model; x, lo, valid: teacher rows as `rows_as_prompts` reads them."""
    from transformers import DynamicCache

    from ...models.compat import CACHE_KW

    out = []
    for i in range(0, len(x), chunk):
        xs, los, vs = x[i:i + chunk], lo[i:i + chunk], valid[i:i + chunk]
        width = int(vs.max())
        # room for a whole block at every anchor (the engine's eff cuts the runs there: `path_tau`)
        xs = torch.cat([xs[:, :width], xs.new_full((len(xs), block), student.mask_id)], 1)
        cache = DynamicCache(config=student.model.config)
        student.model(input_ids=xs, use_cache=True, logits_to_keep=1, **{CACHE_KW: cache})  # the verifier's keys
        start = int(los.min()) - 1
        runs = student.runs(xs, start, block, 1, None, cache)  # [n, A]: anchors start .. width
        out += [runs[r, int(los[r]) - 1 - start:int(vs[r]) - 1 - start].tolist() for r in range(len(xs))]
    return out
