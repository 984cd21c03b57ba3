"""Measure forward costs on this machine: `T_C(B)` for drafting and verifying, and the price of branches.

For each concurrency C (rows in a forward) and block size B the profiler times, over a cached prefix:
* `draft`: one bidirectional block forward, C x B query tokens;
* `verify[S]`: one verify forward carrying S = 0..3 branch segments of B tokens per row (S = 0: LinearSS).
B = 1 is a plain decoding step: no draft forward (`draft` = 0) and no branches (`verify` = one token per row),
unmasked for one request and masked for several (requests in flight together have different lengths).
* `host`: the engine's own work in one LinearSS round of C rows at block B, outside the forwards (cache
  binding, masks, acceptance, commit, stopping, the certainty signal, statistics): engine rounds are timed
  over a backbone whose forward is free (it returns preset logits that reject every draft, so every round
  emits one token), and the per-round slope is kept. On a CPU it is a few percent of a round; on a GPU, where
  a small forward takes milliseconds, it can be a large share, and a policy that ignores it over-values
  small blocks (more rounds, each paying it).
Within one C the parts of all block sizes are timed in turn, pass after pass, and each keeps its median
(`profile_costs`). The table is what the block-size policy and the branch rule read;
`recguide profile --out DIR/cost_table.json` regenerates it for other hardware.

`compiled=True` (`recguide profile --compile`) times the forwards through `recguide_compile`'s compiled forward
on the cache layout a compiled engine uses (the first, untimed pass compiles; its seconds come back as
`compile_warmup_s`). A policy serving compiled reads such a table when the model folder has one
(`cost_table_compiled.json`, `BlockPolicy.from_config`). On the bundled model and a 2-core CPU it did not pay:
the full profile read a 64-row compiled plain step at 78 ms where a profile of C = 64 alone read 45 ms, which
steered the compiled policy off plain steps at C = 64, and at C = 1 and 16 it served as fast as the eager table
(`eval/results/compiled_table_ab`), so the bundled folder ships none.
"""

from __future__ import annotations

import platform
import statistics
import time
from functools import partial

import torch

from ..core.compiled import CompiledForward
from ..core.config import BLOCK_SIZES, DecodingConfig
from ..core.engine import Engine, SamplingSettings
from ..core.masks import block_intra, build_mask, causal_intra, left_pad, positions
from ..models.registry import as_backbone


def _forward_timer(backbone, cache, rows, q, intra, draft_from: int | None = None, forward=None):
    """A function that runs one forward of q tokens per row over the cached prefix and returns its seconds;
    tokens from `draft_from` on are draft tokens (the drafting adapter, if any, applies to them as in the
    engine). `forward`: what runs it (default `backbone.forward`; e.g. a `compiled.CompiledForward`)."""
    forward = forward or backbone.forward
    lengths = cache.lengths[rows.cpu()].to(rows.device)
    pads = torch.zeros_like(lengths)
    ids = torch.randint(4, backbone.vocab_size, (rows.numel(), q), device=rows.device)

    def once() -> float:
        binding = cache.prepare(rows, q)
        cache.use(binding)
        # a plain step over rows of one length runs unmasked in the engine (`Engine._prepare`): one request
        # always does; requests served together have different lengths and need the mask, so C > 1 is timed so
        mask = None if q == 1 and backbone.unmasked_steps and rows.numel() == 1 else build_mask(
            lengths, pads, intra, binding.kv_len, dtype=backbone.dtype)
        pos = positions(lengths, pads, torch.arange(q, device=rows.device))
        if backbone.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        # as the engine passes it: none, all (0: a draft forward) or the branch segments (every column from b on)
        forward(ids, pos, mask, cache, draft_mask=draft_from)
        if backbone.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return once


class _FreeForward:
    """The real backbone's geometry and cache, with a forward that costs nothing: it returns a slice of
    preset logits whose argmax at query place j is token `first + j`, so a draft (read at places 1..) never
    matches what the verifier wants (read at places 0..) and every round emits exactly one token."""

    def __init__(self, real, rows: int, width: int):
        self.real = real
        self.mask_token_id, self.vocab_size = real.mask_token_id, real.vocab_size
        self.device, self.dtype, self.max_positions = real.device, real.dtype, None
        self.unmasked_steps = real.unmasked_steps
        first = 4 if real.mask_token_id >= 4 + width else real.mask_token_id + 1
        self.logits = torch.zeros(rows, width, real.vocab_size, device=real.device)
        self.logits[:, torch.arange(width), first + torch.arange(width)] = 10.0

    def new_cache(self, num_rows: int, capacity: int):
        return self.real.new_cache(num_rows, capacity)

    def forward(self, input_ids, position_ids, attention_mask, cache, draft_mask=None, logits_to_keep=0):
        r, q = input_ids.shape
        if logits_to_keep:
            return self.logits[:r, :logits_to_keep]
        return self.logits[:r, :q]


def _host_timer(backbone, c: int, b: int, rounds: tuple[int, int] = (4, 16)):
    """A function that returns seconds of engine work per LinearSS round of c rows at block b, outside the
    forwards (the slope between two run lengths, so set-up and prefill cancel). The certainty signal is
    computed, as the auto policy computes it every round: a fixed-block engine computes it only when asked for
    its round log, whose appends add a few microseconds per row."""

    config = DecodingConfig(mode="linear", block_size=b)
    prompt = torch.full((c, 8), 4, dtype=torch.long, device=backbone.device)
    mask = (torch.arange(8)[None, :] >= (torch.arange(c) % 4)[:, None]).long()  # rows of different lengths

    def once() -> float:
        free = _FreeForward(backbone, c, max(b, 2))  # made per call: its preset logits can be large

        def run(n: int) -> float:
            engine = Engine(free, config, SamplingSettings(max_new_tokens=n, eos_token_ids=[]))
            start = time.perf_counter()
            engine.generate(prompt, mask.to(backbone.device), log_rounds=True)  # with the certainty signal
            return time.perf_counter() - start

        short, long = run(rounds[0]), run(rounds[1])
        return max((long - short) / (rounds[1] - rounds[0]), 0.0)

    return once


def interleaved_medians(timers: dict, repeats: int) -> dict:
    """{key: median seconds} of `timers` (key -> a function returning seconds), timed in turn, pass after pass;
    the first pass is warm-up. A slow spell of the machine then falls on every key alike."""
    times: dict = {key: [] for key in timers}
    for i in range(repeats + 1):
        for key, once in timers.items():
            t = once()
            if i:
                times[key].append(t)
    return {key: statistics.median(t) for key, t in times.items()}


@torch.no_grad()
def profile_costs(model, concurrencies=(1, 2, 4, 8, 16, 32, 64), block_sizes=BLOCK_SIZES, prefix_len: int = 256,
                  repeats: int = 5, progress=None, compiled: bool = False) -> dict:
    """Seconds per forward, and of the engine's work around them per round:
    {"C": {"B": {"draft": t, "verify": [t(S=0), t(S=1), t(S=2), t(S=3)], "host": t}}}.

    Within one C every part of every block size is timed once per pass, pass after pass (the first pass is
    warm-up), and each keeps its median: a slow spell of the machine then falls on all block sizes alike
    instead of on the few timed during it. The policy compares block sizes at one load, so what it needs
    most is their ratios (a whole C row measured slow only rescales rho_C)."""
    backbone = as_backbone(model)
    device = backbone.device
    forward = CompiledForward(backbone) if compiled else None
    table: dict = {}
    for c in concurrencies:
        cache = backbone.new_cache(c, prefix_len + 5 * max(block_sizes))
        if forward is not None:
            forward.adapt(cache)
        cache.lengths[:] = prefix_len  # attention cost does not depend on what the prefix holds
        rows = torch.arange(c, device=device)
        timer = partial(_forward_timer, backbone, cache, rows, forward=forward)  # (q, intra, draft_from=None)
        timers = {}
        for b in block_sizes:
            if b == 1:
                timers[b, "step"] = timer(1, causal_intra(c, 1, device))
            else:
                timers[b, "draft"] = timer(b, block_intra(c, b, device), 0)
                for s in range(4):  # S branch segments after the verifier's b tokens are draft tokens
                    timers[b, s] = timer(b * (1 + s), causal_intra(c, b * (1 + s), device), b if s else None)
            timers[b, "host"] = _host_timer(backbone, c, b)
        med = interleaved_medians(timers, repeats)
        table[str(c)] = {}
        for b in block_sizes:
            if b == 1:
                entry = {"draft": 0.0, "verify": [med[b, "step"]] * 4}
            else:
                entry = {"draft": med[b, "draft"], "verify": [med[b, s] for s in range(4)]}
            entry["host"] = med[b, "host"]
            table[str(c)][str(b)] = entry
        if progress is not None:
            progress.update(1)
    return {"costs": table, "prefix_len": prefix_len, "device": str(device), "dtype": str(backbone.dtype),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "repeats": repeats, "timing": "interleaved", "compiled": compiled,
            **({"compile_warmup_s": forward.warmup_s} if forward is not None else {})}




def calibrate_table(model, sets: dict[str, list[list[int]]], block_sizes=BLOCK_SIZES, max_new_tokens: int = 128,
                    batch: int = 16, bins: int = 6, signal: str = "entropy", pad_token_id: int | None = None) -> dict:
    """The value table V_B(s, z) (`core.calibrate.fit`) from one LinearSS run at the largest block size over prompt
    sets (name -> prompts as token ids; batches left-padded): every round's accepted drafts and verifier entropy,
    drafted with the model's own `recguide_first_draft`."""
    from tqdm import tqdm

    from ..core.calibrate import Round, fit

    block = max(block_sizes)
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = pad_token_id if pad_token_id is not None else eos_ids[0]
    backbone = as_backbone(model)
    first_draft = DecodingConfig.from_sources(model.generation_config).first_draft  # the folder's draft layout
    rounds: list[Round] = []
    for name, prompts in sets.items():
        for i in tqdm(range(0, len(prompts), batch), desc=f"calibrate {name}"):
            ids, attn = left_pad(prompts[i:i + batch], pad)
            engine = Engine(backbone, DecodingConfig(mode="linear", block_size=block, first_draft=first_draft),
                            SamplingSettings(max_new_tokens=max_new_tokens, eos_token_ids=eos_ids, pad_token_id=pad))
            _, stats = engine.generate(ids.to(backbone.device), attn.to(backbone.device), log_rounds=True)
            t = {}
            for row, _, accepted, _, entropy, first in stats.round_log:
                t[row] = t.get(row, -1) + 1
                rounds.append(Round(name, i + row, t[row], entropy, accepted, first))
    return fit(rounds, tuple(block_sizes), num_bins=bins, signal=signal)
