"""The batched self-speculative decoding engine.

Contract: token ids in, token ids out; it knows nothing about tokenization. A batch of requests
(left-padded prompts) is decoded in rounds. Each round, every active request verifies one block
`[seed, d_1 .. d_K]` with the shared backbone:

    1. draft    [seed, MASK x K] in block-diffusion mode (skipped when a branch of the last round hit)
    2. verify   [seed, d_1 .. d_K] causally, in ONE forward with the request's prospective branches
    3. accept   greedy or speculative sampling (verify.py) on the verifier's processed scores
    4. commit   seed + accepted drafts to the cache (rollback = not advancing), emit tokens
    5. stop     EOS, max_new_tokens and the user's stopping criteria, per request
    6. reuse    a branch whose hypothesis came true supplies the next block (branches.py)

Requests are grouped by planned block size into buckets, one draft and one verify forward per bucket,
so no request pads to a larger block. Finished requests leave the forward batch.

Two ways in: `generate` decodes one static batch (streaming each round's tokens to `on_tokens` if given);
`open` / `submit` / `step` / `cancel` take requests as they come, between rounds, into a fixed number of slots
(continuous batching: a server, or `serve`'s closed loop). Tokens a round emits are final: stopping only ever cuts
inside the round that stopped a request.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from . import branches as br
from .backbone import Backbone
from .compiled import CompiledForward
from .config import DecodingConfig
from .draft import DraftBlock, draft_layout, draft_logits_of, make_draft, risky_positions
from .hooks import NoStopping, VerifierScores
from .masks import build_mask, causal_intra, length_groups, positions
from .phases import Phases
from .policy import BlockPolicy, RoundOutcome
from .stats import Stats
from .verify import Verdict, greedy_verify, sampling_verify


@dataclass
class SamplingSettings:
    """What the engine needs from a GenerationConfig, already resolved."""

    max_new_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    do_sample: bool = False
    draft_temperature: float = 1.0  # temperature of the draft distribution when sampling


@dataclass
class Emission:
    """What one round did for one request (`Engine.step`)."""

    request_id: Hashable
    new_ids: list[int]  # tokens this round emitted, final (empty when the request was only cancelled)
    finished: bool  # the request is done (EOS, its max_new_tokens, a stopping criterion, or cancelled)
    stats: dict | None = None  # its per-request statistics (stats.py), when finished


@dataclass
class Slots:
    """Every request slot's decoding state between rounds, one row per slot (made by `Engine._allocate`; a slot
    holds one request from admission to its end, then the next)."""

    prompt_width: int  # W: every prompt is left-padded to it in `seq`
    seq: torch.Tensor  # [N, W + max_new] the prompt, then the emitted tokens; the last emitted one is the seed
    count: torch.Tensor  # [N] tokens emitted so far
    sent: torch.Tensor  # [N] emitted tokens already handed out (`Engine._take_new`)
    limit: torch.Tensor  # [N] the request's max_new_tokens
    finished: torch.Tensor  # [N] bool: EOS, its limit, a stopping rule, cancelled, or a free slot
    pending: br.PendingBlocks  # next-round drafts a branch already made (its hypothesis came true)
    cache: object  # the backbone's row cache: one committed length per slot
    stats: Stats  # telemetry per slot and in total (nothing reads it back to decide)


class Engine:
    """Decode a batch of requests with LinearSS or RecGuide.

    Args:
        backbone: the shared-backbone adapter (backbone.py; implementations in `recguide_hf.models`).
        config: decoding options (config.py).
        settings: lengths, special tokens and sampling switch.
        processor: verifier logits -> scores (hooks.py; the user's HF logits processors: integrations/processors.py).
        stopper: stopping rules beyond EOS and max_new_tokens (hooks.py; HF criteria: integrations/stopping.py).
        policy: the block-size scheduler (policy.py); default: from the config's tables, with `prices` (the
            online correction of the cost table, kept by the caller across calls; default: a fresh one).
        clock: seconds, for round timing and latencies (a simulation passes its own; default: the wall clock).
        phases: the timing seam (phases.py): every phase of the engine's work runs inside `phases(name)`;
            default: no timing. A profiler passes a `PhaseClock`.
    """

    def __init__(self, backbone: Backbone, config: DecodingConfig, settings: SamplingSettings,
                 processor: VerifierScores | None = None, stopper: NoStopping | None = None,
                 policy: BlockPolicy | None = None, base_dir=None, prices=None,
                 clock: Callable[[], float] = time.perf_counter, phases: Phases | None = None):
        self.backbone, self.config, self.settings, self.clock = backbone, config, settings, clock
        self.phases = phases or Phases()
        self.processor = processor or VerifierScores(backbone.mask_token_id)
        self.stopper = stopper or NoStopping()
        self.policy = policy or BlockPolicy.from_config(config, base_dir, prices)
        self.mask_id = backbone.mask_token_id
        self.wants_entropy = self.policy.reads_entropy  # the entropy signal costs a vocabulary-wide pass per round
        for setting, on in (("recguide_compile=True", config.compile), ("recguide_overlap='streams'",
                                                                       config.overlap == "streams")):
            if on and backbone.spread is not None:  # neither has run on such a model yet
                raise ValueError(f"{setting} does not support a model {backbone.spread} yet; leave it at its "
                                 "default for such a model")
        self.split_streams, self._side_stream = self._streams_setup(config.overlap)
        self._compiled = CompiledForward(backbone) if config.compile else None  # None: eager, the reference

    @property
    def compile_warmup_s(self) -> float | None:
        """Seconds this engine's forwards spent compiling (None: eager)."""
        return self._compiled.warmup_s if self._compiled is not None else None

    def _streams_setup(self, overlap: str):
        if overlap != "streams":
            return False, None
        if self.backbone.device.type == "cuda":
            return True, torch.cuda.Stream(device=self.backbone.device)
        _warn_once("recguide_overlap='streams' needs CUDA; falling back to the fused single-forward layout")
        return False, None

    # ------------------------------------------------------------------ public entries
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, log_rounds: bool = False,
                 on_tokens: Callable[[int, torch.Tensor], None] | None = None):
        """Decode one static batch. Returns (sequences [N, W + max new], Stats).

        Args:
            input_ids: [N, W] left-padded prompts; attention_mask: [N, W] (None = no padding).
            log_rounds: keep `stats.round_log` (row, block, accepted, drafts, entropy, entropy at the seed's
                place) per round (calibration).
            on_tokens: called after every round as `on_tokens(row, new_ids [n])` for each row that emitted tokens
                (a streamer; the ids are a copy).
        """
        device = self.backbone.device
        input_ids = input_ids.to(device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pads = (attention_mask.to(device) == 0).long().cumprod(dim=1).sum(dim=1)  # left padding per row
        self._allocate(*input_ids.shape, whole_batch=True)  # the call returns when its last request is done
        if log_rounds:
            self.slots.stats.round_log = []
        self.wants_entropy = self.policy.reads_entropy or log_rounds
        self._admit(torch.arange(input_ids.shape[0], device=device), input_ids, pads)
        while self._step():
            if on_tokens is not None:
                for row, first, last in self._take_new():
                    on_tokens(row, self.slots.seq[row, first:last].clone())
        width = self.slots.prompt_width + int(self.slots.count.max())
        return self.slots.seq[:, :width], self.slots.stats

    # ------------------------------------------------------------------ requests as they come
    def open(self, slots: int, max_prompt_len: int):
        """Make room for `slots` requests in flight, prompts up to `max_prompt_len` tokens and up to the settings'
        `max_new_tokens` new tokens each. Requests then come and go with `submit`, `step` and `cancel`."""
        self._allocate(slots, max_prompt_len)
        self.slots.finished[:] = True
        self.owner: list[Hashable | None] = [None] * slots  # the request each slot holds
        self.waiting: list[tuple[Hashable, list[int], int]] = []  # submitted, not yet admitted
        self.admitted_at: dict[Hashable, float] = {}

    @property
    def num_running(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def submit(self, request_id: Hashable, prompt_ids: list[int], max_new_tokens: int | None = None):
        """Queue a request; it is admitted (prefilled) at the start of a later `step`, when a slot is free."""
        limit = self.settings.max_new_tokens
        max_new = limit if max_new_tokens is None else max_new_tokens
        if not 1 <= len(prompt_ids) <= self.slots.prompt_width:
            raise ValueError(f"a prompt needs 1 to {self.slots.prompt_width} tokens, got {len(prompt_ids)}")
        if not 0 <= max_new <= limit:
            raise ValueError(f"max_new_tokens must be 0 to {limit}, got {max_new}")
        if request_id in self.admitted_at or any(w[0] == request_id for w in self.waiting):
            raise ValueError(f"request {request_id!r} is already in flight")
        self.waiting.append((request_id, list(prompt_ids), max_new))

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a request: a waiting one never starts; a running one's slot is free for the next step's arrivals.
        Returns whether the request was in flight."""
        for i, w in enumerate(self.waiting):
            if w[0] == request_id:
                del self.waiting[i]
                return True
        if request_id not in self.owner:
            return False
        row = self.owner.index(request_id)
        self.slots.finished[row] = True
        self.slots.pending.has[row] = False
        self._release(row)
        return True

    @torch.no_grad()
    def step(self) -> list[Emission]:
        """Admit waiting requests into free slots, run one round for every running request, and return what it
        emitted: one `Emission` per request that emitted tokens or finished (its slot is then free again)."""
        self._admit_waiting()
        self._step()  # nothing runs when every request is waiting or done (e.g. admitted with max_new_tokens 0)
        out = []
        news = {row: (first, last) for row, first, last in self._take_new()}
        finished = self.slots.finished.tolist()  # one read instead of one per slot
        lo = min((f for f, _ in news.values()), default=0)
        hi = max((t for _, t in news.values()), default=0)
        window = self.slots.seq[:, lo:hi].tolist()  # every row's new tokens in one device read
        for row, rid in enumerate(self.owner):
            if rid is None or (row not in news and not finished[row]):
                continue
            first, last = news.get(row, (lo, lo))
            ids = window[row][first - lo:last - lo]
            if finished[row]:
                stats = {**self.slots.stats.row_summary(row), "latency": self.clock() - self.admitted_at[rid]}
                out.append(Emission(rid, ids, True, stats))
                self._release(row)
            else:
                out.append(Emission(rid, ids, False))
        return out

    def _admit_waiting(self):
        free = [r for r, o in enumerate(self.owner) if o is None]
        if not free or not self.waiting:
            return
        arrivals, self.waiting = self.waiting[: len(free)], self.waiting[len(free):]
        # the longest prompts take the lowest free slots: rows of similar lengths then sit side by side, and
        # attention reads each run of them only as far as it needs (attention.py), not to the longest row
        arrivals.sort(key=lambda a: -len(a[1]))
        device, width = self.backbone.device, self.slots.prompt_width
        rows = torch.tensor(free[: len(arrivals)], device=device)
        ids = torch.full((len(arrivals), width), self.settings.pad_token_id, dtype=torch.long, device=device)
        for k, (_, prompt, _) in enumerate(arrivals):
            ids[k, width - len(prompt):] = torch.tensor(prompt)
        pads = torch.tensor([width - len(a[1]) for a in arrivals], device=device)
        now = self.clock()
        for row, (rid, _, _) in zip(rows.tolist(), arrivals):
            self.owner[row], self.admitted_at[rid] = rid, now
        self._admit(rows, ids, pads, torch.tensor([a[2] for a in arrivals], device=device))

    def _release(self, row: int):
        self.admitted_at.pop(self.owner[row], None)
        self.owner[row] = None

    @torch.no_grad()
    def serve(self, prompts: list[list[int]], slots: int, on_finish=None, on_step=None) -> list[dict]:
        """Closed-loop continuous batching: `slots` requests in flight; a finished request's slot is reused by
        the next queued prompt. Returns one record per prompt (new token ids, latency, per-request stats).

        The call returns when its last request is done: once a step admits the last queued prompt, the requests in
        flight are one static batch and the policy plans for its slowest (`BlockPolicy`, "one static batch"); until
        then a freed slot takes the next prompt and the rate rule holds. (A server's `step` loop never knows that
        nothing more will come, and keeps the rate rule.) `on_finish(request_id, record)` is called as each request
        finishes, `on_step(emissions)` after every step."""
        self.open(slots, max(len(p) for p in prompts))
        for i, prompt in enumerate(prompts):
            self.submit(i, prompt)
        records: list[dict | None] = [None] * len(prompts)
        new_ids: list[list[int]] = [[] for _ in prompts]
        while self.waiting or self.num_running:
            self.policy.whole_batch = len(self.waiting) <= slots - self.num_running
            emissions = self.step()
            for e in emissions:
                new_ids[e.request_id].extend(e.new_ids)
                if e.finished:
                    records[e.request_id] = rec = {"new_ids": new_ids[e.request_id], **e.stats}
                    if on_finish is not None:
                        on_finish(e.request_id, rec)
            if on_step is not None:
                on_step(emissions)
        return records

    def _take_new(self) -> list[tuple[int, int, int]]:
        """(row, first, last): `seq[row, first:last]` are the tokens a row emitted since the last call."""
        out = []
        for row, (sent, count) in enumerate(zip(self.slots.sent.tolist(), self.slots.count.tolist())):
            if count > sent:
                out.append((row, self.slots.prompt_width + sent, self.slots.prompt_width + count))
        self.slots.sent.copy_(self.slots.count)
        return out

    def _step(self) -> bool:
        """One round for every active request (one bucket at a time). False when nothing is active."""
        active = (~self.slots.finished).nonzero().squeeze(1)
        self.last_round: dict[int, int] = {}  # rows per block size in this round (telemetry)
        if active.numel() == 0:
            return False
        timed = self.policy.online
        with self.phases("plan"):
            remaining = self.slots.limit[active] - self.slots.count[active]
            buckets = list(self.policy.buckets(active, self.slots.pending.has, remaining))
        for block, rows in buckets:
            if self.stopper.ended:  # the user's criteria ended the whole batch in an earlier bucket
                break
            self.last_round[block] = self.last_round.get(block, 0) + rows.numel()
            start = self.clock() if timed else 0.0
            compiling = self.compile_warmup_s
            if block == 1:
                with self.phases("plain"):
                    outcome = self._plain_round(rows)
            else:
                outcome = self._round(rows, block)
            # the policy corrects its cost table by what rounds really take here (not by a round that compiled);
            # ranks that run one split model agree on both numbers, so they plan their next rounds alike
            if timed:
                if self.backbone.device.type == "cuda":
                    torch.cuda.synchronize(self.backbone.device)
                seconds, compiled = self.backbone.agree([self.clock() - start, self.compile_warmup_s != compiling])
                outcome.seconds = None if compiled else seconds
            with self.phases("observe"):
                self.policy.observe(outcome)
        return True

    # ------------------------------------------------------------------ setup
    def _allocate(self, num_rows: int, prompt_width: int, whole_batch: bool = False):
        """Buffers for `num_rows` request slots whose (left-padded) prompts are at most `prompt_width` long.
        `whole_batch`: one static batch (`generate`), which the policy times by its slowest request."""
        device = self.backbone.device
        max_new = self.settings.max_new_tokens
        limit = self.backbone.max_positions
        if limit is not None and prompt_width + max_new > limit:
            raise ValueError(f"prompt length {prompt_width} + max_new_tokens {max_new} exceeds the model's maximum "
                             f"positions ({limit}); shorten the prompt or lower max_new_tokens")
        # branch segments (3 x B), plus a copy of the verifier segment when they run on a second stream
        branch_width = 4 * self.policy.max_block if self.config.branches_enabled else 0
        capacity = prompt_width + max_new + self.policy.max_block + branch_width
        count = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.slots = Slots(
            prompt_width=prompt_width,
            seq=torch.full((num_rows, prompt_width + max_new), self.settings.pad_token_id, dtype=torch.long,
                           device=device),
            count=count, sent=torch.zeros_like(count), limit=torch.full_like(count, max_new),
            finished=torch.zeros(num_rows, dtype=torch.bool, device=device),
            pending=br.PendingBlocks(num_rows, self.policy.max_block, device),
            cache=self.backbone.new_cache(num_rows, capacity), stats=Stats(num_rows))
        if self._compiled is not None:  # few code paths, so few graphs per compiled forward kind (compiled.py)
            self._compiled.adapt(self.slots.cache)
        self.eos_ids = torch.tensor(self.settings.eos_token_ids, dtype=torch.long, device=device)
        self.policy.start(num_rows)
        self.policy.whole_batch = whole_batch
        self.stopper.start(self.slots.seq, prompt_width)

    def _admit(self, rows: torch.Tensor, input_ids: torch.Tensor, pads: torch.Tensor,
               limits: torch.Tensor | None = None):
        """Start requests in `rows`: prompts `input_ids` [R, W] left-padded by `pads` [R], each generating up to
        `limits` [R] new tokens (default: the settings' max_new_tokens)."""
        if bool((pads >= self.slots.prompt_width).any()):
            raise ValueError("Every prompt needs at least one token (found an empty, all-padding prompt)")
        self.slots.seq[rows] = self.settings.pad_token_id
        self.slots.seq[rows, : self.slots.prompt_width] = input_ids
        self.slots.count[rows] = 0
        self.slots.sent[rows] = 0
        self.slots.limit[rows] = self.settings.max_new_tokens if limits is None else limits
        self.slots.finished[rows] = self.slots.limit[rows] <= 0
        self.slots.pending.has[rows] = False
        with self.phases("admit"):
            self.slots.stats.reset_rows(rows)
            self.policy.reset_rows(rows)
            self.slots.cache.reset_rows(rows)
            self._prefill(rows, input_ids, pads)

    def _prefill(self, rows: torch.Tensor, input_ids: torch.Tensor, pads: torch.Tensor):
        """Write all prompt tokens but the last (the first seed) into the cache, from slot 0 and without the
        left padding: each row's tokens are shifted left (right-padded in this forward, whose padded places are
        never committed), so the cache holds no padding, a row's position is its slot, and a row's mask only
        has to hide slots past its own length (none at all for rows of one length)."""
        w = input_ids.shape[1]
        lengths = w - 1 - pads  # prompt tokens before the seed, per row
        # rows of similar lengths share a forward: padding a batch to its longest prompt cost more than
        # the extra forwards (32 held-out prompts, median 149 tokens, longest 318: 1.66 s in one forward,
        # 0.64 s in length-sorted groups, on the 2-core CPU)
        for group in length_groups(lengths.tolist()):
            index = torch.tensor(group, device=input_ids.device)
            width = int(lengths[index].max())
            if width == 0:
                continue
            col = torch.arange(width, device=input_ids.device)
            packed = input_ids[index].gather(1, (pads[index, None] + col[None, :]).clamp(max=w - 2))
            offsets = col[None, :].expand(len(group), -1)
            self._forward(rows[index], packed, offsets, causal_intra(len(group), width, input_ids.device),
                          logits_to_keep=1)
        self.slots.cache.commit(rows, lengths)

    # ------------------------------------------------------------------ one round for one bucket
    def _round(self, rows: torch.Tensor, block: int) -> RoundOutcome:
        slots = self.slots
        remaining = slots.limit[rows] - slots.count[rows]
        eff = remaining.clamp(max=block)  # [R] tokens this round may emit = verifier segment length
        seeds = slots.seq[rows, slots.prompt_width + slots.count[rows] - 1]
        branches_on = (block > 1 and self.config.branches_enabled and self.policy.branches_on(rows.numel(), block))
        phase = self.phases
        # 1. draft (rows whose block a branch already drafted skip the draft forward)
        with phase("draft"):
            draft = self._draft(rows, seeds, eff, block, with_risk=branches_on)
        # 2. verify, with this round's branches riding in the same forward
        with phase("branch_plan"):
            plan = self._plan(draft, eff, block) if branches_on else None
        with phase("verify"):
            target_logits, branch_logits = self._verify(rows, seeds, draft.ids, eff, plan)
        # 3. accept
        with phase("process"):
            block_ids = torch.cat([seeds[:, None], draft.ids], dim=1)
            scores = self.processor(slots.seq, slots.prompt_width, slots.count[rows], rows, block_ids, target_logits,
                                    eff)
        with phase("accept"):
            verdict = self._accept(draft, scores, eff - 1)
        # 4. commit + emit, 5. stop
        with phase("commit"):
            emitted = self._commit(rows, draft.ids, verdict)
        # 6. reuse a branch whose hypothesis came true
        with phase("reuse"):
            temperature = self.settings.draft_temperature if self.settings.do_sample else None
            hits = br.reuse(plan, verdict, eff - 1, branch_logits, self.mask_id, self.settings.eos_token_ids,
                            temperature)
            hits = hits.drop(slots.finished[rows])  # a finished request has no next round to reuse it in
            slots.pending.store(rows, hits)
        with phase("record"):
            # the certainty signal is read only by the auto policy (and calibration's round log)
            entropy = verifier_entropy(scores, verdict.num_accepted, eff) if self.wants_entropy else None
            # calibration also logs what a plain step would have read here: the entropy at the seed's place alone
            logging = slots.stats.round_log is not None
            first = verifier_entropy(scores, torch.zeros_like(eff), eff) if logging else None
            slots.stats.record_round(rows, block, emitted, verdict.num_accepted, eff - 1, hits.kind,
                                     plan is not None, entropy, first)
        return RoundOutcome(rows, block, verdict.num_accepted, eff - 1, entropy,
                            branch_hits=None if plan is None else int((hits.kind >= 0).sum()),
                            branch_segments=0 if plan is None else int((plan.kind >= 0).sum()))

    def _plain_round(self, rows: torch.Tensor) -> RoundOutcome:
        """B = 1, the fallback: one plain decoding step per row. The same steps as `_round` at B = 1 (where
        the draft is empty, nothing is accepted and no branch rides), without the block bookkeeping."""
        slots = self.slots
        r = rows.numel()
        count = slots.count[rows]
        seeds = slots.seq[rows, slots.prompt_width + count - 1][:, None]  # [R, 1]
        logits = self._forward(rows, seeds, count.new_zeros(r, 1), causal_intra(r, 1, rows.device))
        slots.stats.record_forward(rows, 1)
        one, none = torch.ones_like(count), torch.zeros_like(count)
        scores = self.processor(slots.seq, slots.prompt_width, count, rows, seeds, logits, one)
        no_drafts = seeds[:, :0]  # [R, 0]
        if self.settings.do_sample:  # the bonus token of an empty block, drawn as `_round` draws it
            empty = DraftBlock(no_drafts, None, None, scores.new_zeros(r, 0, scores.shape[-1]))
            verdict = self._accept(empty, scores, none)
        else:
            verdict = Verdict(none, scores[:, 0].argmax(-1))
        emitted = self._commit(rows, no_drafts, verdict)
        slots.pending.has[rows] = False
        entropy = verifier_entropy(scores, none, one) if self.wants_entropy else None
        slots.stats.record_round(rows, 1, emitted, none, none, torch.full_like(count, -1), False, entropy)
        return RoundOutcome(rows, 1, none, none, entropy)

    def _draft(self, rows: torch.Tensor, seeds: torch.Tensor, eff: torch.Tensor, block: int,
               with_risk: bool) -> DraftBlock:
        """Drafts d_1 .. d_{block-1} for every row of the bucket (from a branch hit or a draft forward)."""
        have, draft = self.slots.pending.take(rows, block - 1)
        if self.settings.do_sample and draft.probs is None:
            vocab = self.backbone.vocab_size
            draft.probs = torch.zeros(rows.numel(), block - 1, vocab, device=rows.device)
        need = (~have) & (eff > 1)
        if not bool(need.any()):
            return draft
        sub, sub_eff = rows[need], eff[need]
        q = int(sub_eff.max())
        ids, intra, offsets, draft_mask = draft_layout(seeds[need], sub_eff, q, self.mask_id, self.config.first_draft)
        logits = self._forward(sub, ids, offsets, intra, draft_mask=draft_mask)  # [S, q, V]
        draft_logits = draft_logits_of(logits, self.config.first_draft)
        self.slots.stats.record_forward(sub, q)
        temperature = self.settings.draft_temperature if self.settings.do_sample else None
        fresh = make_draft(draft_logits, self.mask_id, self.settings.eos_token_ids, temperature, with_risk)
        for name in ("ids", "margin", "correction", "probs"):
            target = getattr(draft, name)
            if target is not None and getattr(fresh, name) is not None:
                target[need, : q - 1] = getattr(fresh, name)
        return draft

    def _plan(self, draft: DraftBlock, eff: torch.Tensor, block: int) -> br.BranchPlan:
        risky = risky_positions(draft, eff - 1, self.config.delta, self.config.max_corrections)
        return br.plan(risky, eff, block, self.config.continuation, self.mask_id)

    def _verify(self, rows, seeds, draft_ids, eff, plan):
        """Verifier segment first, then branch segments, in one fused forward (or two concurrent CUDA streams).

        Returns target logits [R, Q, V] and branch logits [R, S*B, V] (None without branches).
        """
        r = rows.numel()
        q = int(eff.max())
        ids = torch.cat([seeds[:, None], draft_ids], dim=1)[:, :q]
        valid = torch.arange(q, device=rows.device)[None, :] < eff[:, None]
        intra = causal_intra(r, q, rows.device) & valid[:, None, :]
        offsets = torch.arange(q, device=rows.device).expand(r, -1)
        if plan is None:  # verifier tokens only: the base weights alone
            logits = self._forward(rows, ids, offsets, intra)
            self.slots.stats.record_forward(rows, q)
            return logits, None
        full = br.append_segments(plan, ids, offsets, intra)
        if self.split_streams:
            return self._verify_two_streams(rows, (ids, offsets, intra), full, q)
        # the branch segments are every column from q on (unused segments are invisible and never read)
        logits = self._forward(rows, full[0], full[1], full[2], draft_mask=q)
        self.slots.stats.record_forward(rows, full[0].shape[1])
        return logits[:, :q], logits[:, q:]

    def _verify_two_streams(self, rows, verifier, full, q):
        """`recguide_overlap="streams"`: the verifier segment on the current stream, the branch layout (with
        its own copy of the verifier tokens, written to later scratch slots) on a second stream. Both
        forwards are prepared before either is launched, so nothing waits for the device in between."""
        prep_v = self._prepare(rows, verifier[0], verifier[1], verifier[2])
        prep_b = self._prepare(rows, full[0], full[1], full[2], write_offset=q)
        main = torch.cuda.current_stream() if self._side_stream is not None else None
        if main is not None:
            self._side_stream.wait_stream(main)
        logits = self._run(prep_v, verifier[0])  # the base weights alone
        if main is not None:
            with torch.cuda.stream(self._side_stream):
                branch_logits = self._run(prep_b, full[0], q)[:, q:]
            main.wait_stream(self._side_stream)
        else:  # CPU: the same two forwards one after the other (tests exercise this path)
            branch_logits = self._run(prep_b, full[0], q)[:, q:]
        self.slots.stats.record_forward(rows, full[0].shape[1] + q)  # the pair counts as one (concurrent) forward
        return logits, branch_logits

    def _accept(self, draft: DraftBlock, scores: torch.Tensor, draft_len: torch.Tensor):
        k = scores.shape[1] - 1
        if not self.settings.do_sample:
            return greedy_verify(draft.ids[:, :k], scores.argmax(-1), draft_len)
        target_probs = torch.softmax(scores, dim=-1)
        return sampling_verify(draft.ids[:, :k], draft.probs[:, :k], target_probs, draft_len)

    def _commit(self, rows, draft_ids, verdict) -> torch.Tensor:
        """Write emitted tokens, advance the cache, apply stopping: the one commit path of every round (a plain
        step is an empty draft). Returns tokens emitted per row [R]."""
        slots = self.slots
        n_acc = verdict.num_accepted
        k = draft_ids.shape[1]
        idx = torch.arange(k + 1, device=rows.device)
        new = torch.cat([draft_ids, draft_ids.new_zeros(draft_ids.shape[0], 1)], dim=1)  # [R, k+1]
        new.scatter_(1, n_acc[:, None], verdict.next_token[:, None])
        num_new = n_acc + 1
        # EOS inside the emitted tokens: keep it, drop what follows
        if self.settings.eos_token_ids:
            eos = torch.isin(new, self.eos_ids)
            eos &= idx[None, :] < num_new[:, None]
            has_eos = eos.any(1)
            first = torch.where(has_eos, eos.float().argmax(1) + 1, num_new)
            num_new = torch.minimum(num_new, first)
        else:
            has_eos = torch.zeros_like(n_acc, dtype=torch.bool)
        slots.cache.commit(rows, n_acc + 1)  # seed + accepted drafts; the new seed is not in the cache yet
        old = slots.count[rows].clone()
        write = (idx[None, :] < num_new[:, None]).nonzero(as_tuple=True)  # (row in bucket, place) pairs
        slots.seq[rows[write[0]], slots.prompt_width + old[write[0]] + write[1]] = new[write]
        slots.count[rows] = old + num_new
        done = has_eos | (slots.count[rows] >= slots.limit[rows])
        slots.finished[rows] |= done
        self.stopper.check(slots.seq, slots.count, slots.finished, old_counts=(rows, old))
        return slots.count[rows] - old

    # ------------------------------------------------------------------ the forward
    def _forward(self, rows, ids, offsets, intra, draft_mask=None, logits_to_keep=0):
        return self._run(self._prepare(rows, ids, offsets, intra), ids, draft_mask, logits_to_keep)

    def _prepare(self, rows, ids, offsets, intra, write_offset: int = 0):
        """Cache binding, additive mask and position ids of one forward (no device wait).

        The cache holds no padding (`_prefill`), so a plain step (one query per row) over rows of one
        committed length sees every slot before it, which is what the model does with no mask at all: then
        no mask is built and attention takes its unmasked path, as in HF's own decoding step."""
        binding = self.slots.cache.prepare(rows, ids.shape[1], write_offset)
        lengths_cpu = self.slots.cache.lengths[rows.cpu()]
        lengths = lengths_cpu.to(ids.device)
        pads = torch.zeros_like(lengths)
        pos = positions(lengths, pads, offsets)
        if (ids.shape[1] == 1 and write_offset == 0 and self.backbone.unmasked_steps
                and bool((lengths_cpu == lengths_cpu[0]).all())):
            return binding, None, pos
        mask = build_mask(lengths, pads, intra, binding.kv_len, dtype=self.backbone.dtype, write_offset=write_offset)
        return binding, mask, pos

    def _run(self, prepared, ids, draft_mask=None, logits_to_keep=0):
        binding, mask, pos = prepared
        self.slots.cache.use(binding)
        forward = self._compiled or self.backbone.forward
        with self.phases("forward"):
            return forward(ids, pos, mask, self.slots.cache, draft_mask=draft_mask, logits_to_keep=logits_to_keep)


_WARNED: set[str] = set()


def _warn_once(message: str):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def verifier_entropy(scores: torch.Tensor, num_accepted: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """Mean verifier entropy [R] over causally valid positions: those up to the first mismatch.

    Args:
        scores: [R, Q, V] processed verifier scores; num_accepted, eff: [R].
    """
    logp = torch.log_softmax(scores.float(), dim=-1)
    ent = -(logp.exp() * logp).nan_to_num().sum(-1)  # [R, Q]; -inf scores contribute 0
    idx = torch.arange(ent.shape[1], device=ent.device)
    valid = idx[None, :] <= torch.minimum(num_accepted, eff - 1)[:, None]
    return (ent * valid).sum(1) / valid.sum(1).clamp(min=1)
