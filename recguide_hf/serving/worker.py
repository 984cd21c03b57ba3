"""RecGuide's continuous batching behind a thread: requests come and go between rounds.

`EngineWorker` owns the engines and one decoding thread. Callers (the HTTP server, a benchmark) `submit` a
request with a callback, and get each round's tokens through it as `Emission`s, the last one with
`finished=True`; `cancel` frees a request's row at the next round. It knows nothing of HTTP or text: token ids
in, token ids out.

Greedy requests share one engine (one batch, per-request block sizes). Sampled requests are batched per
sampling setting (temperature, top-p): each setting in flight gets its own engine, since the engine applies one
set of logits processors to all its rows; the thread steps every engine that has work, one round each in turn.

Admission is bounded: at most `slots` requests decode at once per engine and at most `max_waiting` more wait;
past that `submit` raises `Overloaded` (the server answers 503) instead of queueing without bound.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from ..core.config import DecodingConfig
from ..core.engine import Emission, Engine, SamplingSettings
from ..core.policy import OnlinePrices
from ..integrations.processors import ScoreProcessor
from ..models.registry import as_backbone
from .metrics import Metrics


class Overloaded(Exception):
    """The worker holds as many requests as it may; try again later."""


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens: greedy (temperature 0) or sampled with a temperature and top-p."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    on_event: Callable[[Emission], None]
    submitted: float
    first_token: float | None = None
    last_emit: float | None = None
    num_tokens: int = 0
    engine: Engine | None = None


@dataclass
class WorkerLimits:
    """What the worker accepts (documented in docs/serving.md)."""

    slots: int = 16  # requests decoding at once per sampling setting (rows of the KV cache)
    max_waiting: int = 64  # requests queued beyond the running ones before `submit` refuses
    max_prompt_tokens: int = 1024  # prompt length limit (the cache's prompt width)
    max_new_tokens: int = 512  # `max_tokens` limit per request
    max_sampling_settings: int = 4  # distinct (temperature, top-p) settings decoding at once


class EngineWorker:
    """Decode requests from many callers on one thread, in rounds shared by all of them.

    Args:
        model: a self-speculative model (any `recguide_hf.generate` accepts).
        limits: sizes and bounds (`WorkerLimits`).
        config: decoding options; default: the model's generation config (`recguide_*` keys).
        clock: seconds for latencies (default: the wall clock).
    """

    def __init__(self, model, limits: WorkerLimits | None = None, config: DecodingConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.model, self.limits, self.clock = model, limits or WorkerLimits(), clock
        gen_config = model.generation_config
        self.config = config or DecodingConfig.from_sources(gen_config)
        if self.config.mode == "ar":
            self.config = DecodingConfig(mode="linear", block_size=1)  # plain steps, the engine's own AR
        self.backbone = as_backbone(model)
        eos = gen_config.eos_token_id
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = gen_config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.base_dir = getattr(model.config, "_name_or_path", None)
        # a request that names no temperature decodes as the model's generation config says
        self.default_sampling = Sampling(float(gen_config.temperature or 1.0), float(gen_config.top_p or 1.0)) \
            if gen_config.do_sample else Sampling()
        self.prices = OnlinePrices()  # the auto policy's measured prices, shared by every engine of this worker
        self.metrics = Metrics()
        self._engines: dict[Sampling, Engine] = {}
        self._requests: dict[Hashable, _Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards `_requests` between callers and the thread
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="recguide-engine", daemon=True)
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ callers' side (any thread)
    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0):
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt_ids: list[int], max_new_tokens: int, on_event: Callable[[Emission], None],
               sampling: Sampling = Sampling()) -> Hashable:
        """Queue a request; returns its id. `on_event` is called on the worker's thread with each round's
        `Emission` (keep it short: hand the tokens to your own thread or event loop)."""
        lim = self.limits
        if not 1 <= len(prompt_ids) <= lim.max_prompt_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this server takes 1 to "
                             f"{lim.max_prompt_tokens}")
        if not 1 <= max_new_tokens <= lim.max_new_tokens:
            raise ValueError(f"max_tokens must be 1 to {lim.max_new_tokens}, got {max_new_tokens}")
        with self._lock:
            if not self.alive:
                raise Overloaded("the decoding thread is not running")
            if len(self._requests) >= lim.slots + lim.max_waiting:
                self.metrics.rejected += 1
                raise Overloaded(f"{len(self._requests)} requests in flight, the most this server queues")
            settings = {r.sampling for r in self._requests.values() if not r.sampling.greedy}
            if not sampling.greedy and sampling not in settings and len(settings) >= lim.max_sampling_settings:
                self.metrics.rejected += 1
                raise Overloaded(f"{len(settings)} sampling settings (temperature, top_p) are decoding; "
                                 "retry, or use one of theirs")
            rid = next(self._ids)
            self._requests[rid] = _Request(list(prompt_ids), max_new_tokens, sampling, on_event, self.clock())
        self._inbox.put(("submit", rid))
        self._wake.set()
        return rid

    def cancel(self, rid: Hashable):
        """Stop a request (its client left): its row is free at the next round; no further events."""
        self._inbox.put(("cancel", rid))
        self._wake.set()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._lock:
            running = sum(e.num_running for e in list(self._engines.values()))
            return running, len(self._requests) - running

    # ------------------------------------------------------------------ the decoding thread
    def _run(self):
        try:
            with torch.no_grad():
                while not self._stop.is_set():
                    self._drain_inbox()
                    busy = [e for e in self._engines.values() if e.num_running or e.num_waiting]
                    if not busy:
                        self._wake.wait(0.5)
                        self._wake.clear()
                        continue
                    for engine in busy:
                        self._round(engine)
        except BaseException as err:  # noqa: BLE001 - reported to every waiting caller, then re-raised
            self.error = err
            with self._lock:
                pending, self._requests = self._requests, {}
            for rid in pending:
                pending[rid].on_event(Emission(rid, [], True, {"error": repr(err)}))
            raise

    def _drain_inbox(self):
        while True:
            try:
                kind, rid = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                req = self._requests.get(rid)
            if req is None:
                continue
            if kind == "submit":
                req.engine = self._engine_for(req.sampling)
                req.engine.submit(rid, req.prompt_ids, req.max_new_tokens)
            elif kind == "cancel":
                if req.engine is not None:
                    req.engine.cancel(rid)
                with self._lock:
                    self._requests.pop(rid, None)
                self.metrics.cancelled += 1

    def _round(self, engine: Engine):
        start = self.clock()
        events = engine.step()
        now = self.clock()
        self.metrics.round_seconds.observe(now - start)
        for e in events:
            with self._lock:
                req = self._requests.get(e.request_id)
                if req is not None and e.finished:
                    del self._requests[e.request_id]
            if req is None:  # cancelled meanwhile
                continue
            if e.new_ids:
                if req.first_token is None:
                    req.first_token = now
                    self.metrics.ttft.observe(now - req.submitted)
                else:
                    self.metrics.itl.observe(now - req.last_emit)
                req.last_emit = now
                req.num_tokens += len(e.new_ids)
                self.metrics.tokens += len(e.new_ids)
            if e.finished:
                self.metrics.finished += 1
                self.metrics.e2e.observe(now - req.submitted)
                if req.num_tokens > 1:
                    self.metrics.tpot.observe((now - req.first_token) / (req.num_tokens - 1))
                self.metrics.blocks.update((e.stats or {}).get("block_sizes", {}))
            req.on_event(e)
        self._drop_idle(engine)

    def _engine_for(self, sampling: Sampling) -> Engine:
        engine = self._engines.get(sampling)
        if engine is None:
            lim = self.limits
            processors = LogitsProcessorList()
            if not sampling.greedy:
                if sampling.temperature != 1.0:
                    processors.append(TemperatureLogitsWarper(sampling.temperature))
                if sampling.top_p < 1.0:
                    processors.append(TopPLogitsWarper(sampling.top_p))
            settings = SamplingSettings(max_new_tokens=lim.max_new_tokens, eos_token_ids=self.eos_ids,
                                        pad_token_id=self.pad_id, do_sample=not sampling.greedy,
                                        draft_temperature=sampling.temperature or 1.0)
            engine = Engine(self.backbone, self.config, settings,
                            ScoreProcessor(processors, self.backbone.mask_token_id), base_dir=self.base_dir,
                            prices=self.prices, clock=self.clock)
            engine.open(lim.slots, lim.max_prompt_tokens)
            self._engines[sampling] = engine
        return engine

    def _drop_idle(self, engine: Engine):
        """A sampling setting's engine (its cache rows) goes once it has nothing to do; the greedy one stays."""
        if not (engine.num_running or engine.num_waiting):
            for key, e in list(self._engines.items()):
                if e is engine and not key.greedy:
                    del self._engines[key]

