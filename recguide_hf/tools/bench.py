"""`recguide bench`: the concurrency frontier, measured with every method in the same run.

Methods: `ar` (plain HF greedy `generate`, static batches of C), HF's fast paths `ar-static` (static cache),
`ar-compile` (static cache + HF's own compiled forward, `CompileConfig`, as `generate` does by itself on CUDA; an
untimed first pass over the same requests compiles every shape, its time reported as the row's `warmup_s`) and
`hf-cb` (HF continuous batching, `generate_batch` with at most C requests at once: a closed loop, C > 1 only; its
manager's start-up is `setup_s`, outside the timing), `hf-lookup` (HF assisted generation with
prompt lookup) and `hf-assisted` (HF assisted generation with a small AR draft model, `assistant_model=`,
HF's default schedule; `hf-assisted:num_assistant_tokens=4,assistant_confidence_threshold=0` for a fixed
one): both batch 1 only, so C = 1 only; `linear-N` (LinearSS, fixed B = N) and `recguide` (auto block
size, branches by the cost rule; `recguide:block_sizes=8,16,32` for the paper's candidates, any
`recguide_*` setting likewise). HF methods run on the verifier alone (a folder's drafting adapter is
not attached for them). Engine methods run closed loop: C slots, a finished request's slot takes the
next prompt. Methods are interleaved inside every (repeat, C) and their order rotates between
repeats, so machine drift hits all alike; figures are medians over repeats. Every method's greedy output
is compared token for token with `ar` at C = 1 (batch 1, fp32).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationMixin

from ..core.backbone import Backbone
from ..core.config import DecodingConfig
from ..core.costs import CostTable
from ..core.engine import Engine, SamplingSettings
from ..core.policy import cost_table_of
from ..models.registry import as_backbone

METHODS = ("ar", "ar-static", "ar-compile", "hf-cb", "hf-lookup", "hf-assisted",
           "hf-assisted:num_assistant_tokens=8,assistant_confidence_threshold=0",
           "linear-2", "linear-4", "linear-8", "linear-16", "recguide", "recguide:block_sizes=8,16,32")
BASES = ("ar", "ar-static", "ar-compile", "hf-cb", "hf-lookup", "hf-assisted", "linear", "recguide")
HF_METHODS = ("ar", "ar-static", "ar-compile", "hf-cb", "hf-lookup", "hf-assisted")  # HF's own decoding
HF_AR = ("ar", "ar-static", "ar-compile", "hf-cb")  # HF's autoregressive decoding paths (no drafting)
MANY_ONLY = ("hf-cb",)  # continuous batching: a closed loop of C > 1 requests (C = 1 is plain decoding)
# what a --virtual-costs run compares by default (the verifier's forwards are what the cost model prices)
VIRTUAL_METHODS = ("ar", "linear-4", "linear-8", "linear-16", "linear-32", "recguide", "recguide:block_sizes=8,16,32")
BATCH_ONE = ("hf-lookup", "hf-assisted")  # HF's assisted generation raises for batch > 1
ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def parse_method(method: str) -> tuple[str, dict[str, str]]:
    """`"recguide:rho=0,block_sizes=8,16,32"` -> ("recguide", {"recguide_rho": "0", "recguide_block_sizes": "8,16,32"}).

    `linear-N` -> ("linear", {"recguide_block_size": "N"}). `recguide` takes any `recguide_*` setting without its
    prefix (ablations such as the rho sweep are then one bench run with every variant interleaved);
    `hf-assisted` takes the assistant's schedule settings (ASSISTANT_KEYS). A comma followed by no `=` continues
    the previous value, so lists need no quoting.
    """
    head, _, rest = method.partition(":")
    base = "linear" if head.startswith("linear-") and head[7:].isdigit() else head
    if base not in BASES:
        raise ValueError(f"unknown method {method!r}; choose from ar, ar-static, ar-compile, hf-cb, hf-lookup, "
                         "hf-assisted, linear-N, recguide (recguide and hf-assisted also as NAME:key=value,...)")
    overrides: dict[str, str] = {"recguide_block_size": head[7:]} if base == "linear" else {}
    key = None
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq and key is not None:
            overrides[key] += "," + item.strip()
            continue
        if not eq or base not in ("recguide", "hf-assisted"):
            raise ValueError(f"bad method {method!r}: only recguide and hf-assisted take overrides, as NAME:key=value")
        if base == "hf-assisted" and name.strip() not in ASSISTANT_KEYS:
            raise ValueError(f"bad method {method!r}: hf-assisted takes {ASSISTANT_KEYS}")
        key = f"recguide_{name.strip()}" if base == "recguide" else name.strip()
        overrides[key] = value.strip()
    return base, overrides


def runs_at(method: str, c: int) -> bool:
    """Whether a method runs at concurrency c (assisted generation only at 1, continuous batching only above)."""
    base = parse_method(method)[0]
    return not ((base in BATCH_ONE and c != 1) or (base in MANY_ONLY and c == 1))


def compiles(method: str) -> bool:
    """Whether a method compiles its forward (ar-compile, or recguide:compile=true): its first pass is warm-up."""
    base, overrides = parse_method(method)
    return base == "ar-compile" or overrides.get("recguide_compile", "").lower() in ("true", "1")


def compile_cache_state() -> dict:
    """torch's on-disk compile cache (inductor's kernels) as a bench starts: `empty` means a compiling method's first
    warm-up of the run is a cold start; kernels that earlier processes compiled make it cheaper."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = Path(cache_dir())
    return {"dir": str(path), "empty": not (path.is_dir() and any(path.iterdir()))}


def compile_config():
    """HF's own automatic compilation of the decoding forward (what `generate` does by itself on CUDA with a
    static cache), switched on for every device."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True  # HF's switch: compile on CPU too, not only on CUDA / XPU
    return config


def ar_compile_kwargs() -> dict:
    """`generate` keywords of `ar-compile`: HF's static cache with its own compiled decoding forward."""
    return dict(cache_implementation="static", compile_config=compile_config())


def _order_key(method: str):
    base, overrides = parse_method(method)
    return BASES.index(base), int(overrides.get("recguide_block_size", 0)) if base == "linear" else 0, method


def _engine_config(method: str, gen_config) -> DecodingConfig:
    base_name, overrides = parse_method(method)
    base = DecodingConfig.from_sources(gen_config)  # the folder's own draft layout holds for every method
    if base_name == "linear":
        return DecodingConfig(mode="linear", block_size=int(overrides["recguide_block_size"]),
                              first_draft=base.first_draft)
    config = DecodingConfig(mode="recguide", block_size="auto", block_sizes=base.block_sizes,
                            cost_table=base.cost_table, value_table=base.value_table, rho=base.rho,
                            first_draft=base.first_draft)
    if not overrides:
        return config
    settings = {f"recguide_{f.name}": getattr(config, f.name) for f in dataclasses.fields(config)}
    return DecodingConfig.from_sources(None, **(settings | overrides))


class VirtualCosts:
    """A simulation's clock (`recguide bench --virtual-costs FILE`): the real engine runs and decides as it would
    (acceptance, branches, block sizes), but every forward is charged a cost model's seconds for its token count
    (rows x query width) instead of the time it took here, and nothing else costs time. The file holds published
    round times and how the curve is filled from them (eval/costs/nld8b_b200.json); `cost_table` gives the
    policy the same prices, so it plans for that hardware."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        spec = json.loads(self.path.read_text())
        self.name = spec["name"]
        # one point per published cell: a round is a draft and a verify forward over C x B tokens, half each
        self.points = sorted((int(c) * int(b), ms / 2 / 1000) for c, per_b in spec["published_round_ms"].items()
                             for b, ms in per_b.items())
        self.now = 0.0

    def seconds(self, tokens: int) -> float:
        """The cost of one forward over `tokens` tokens: linear between points, flat below, last slope above."""
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (tokens - n1) / (n1 - n0)

    def charge(self, tokens: int) -> None:
        self.now += self.seconds(tokens)

    def perf_counter(self) -> float:
        return self.now

    def cost_table(self, concurrencies=(1, 2, 4, 8, 16, 32, 64, 128), blocks=(1, 2, 4, 8, 16, 32, 64)) -> dict:
        """The curve as a `recguide profile` table: draft and verify (0 to 3 branch segments of B tokens per row)."""
        costs = {str(c): {str(b): {"draft": 0.0 if b == 1 else self.seconds(c * b),
                                   "verify": [self.seconds(c * b * (1 + (s if b > 1 else 0))) for s in range(4)],
                                   "host": 0.0} for b in blocks} for c in concurrencies}
        return {"costs": costs, "virtual": self.name, "source_file": str(self.path)}

    def charged(self, backbone: Backbone) -> Backbone:
        """`backbone` with every forward charged to this clock by its tokens: give it to the engine, whose clock is
        `perf_counter`."""
        return _Charged(backbone, self)

    @contextlib.contextmanager
    def charging(self, hf_model):
        """While inside: every forward of `hf_model` (HF generate) is charged by its tokens (a forward pre-hook)."""
        handle = hf_model.register_forward_pre_hook(
            lambda module, args, kwargs: self.charge(kwargs["input_ids"].numel() if kwargs.get("input_ids")
                                                     is not None else args[0].numel()), with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()


class _Charged(Backbone):
    """A backbone whose forwards cost a `VirtualCosts` clock their tokens (rows x query width), then run."""

    def __init__(self, inner: Backbone, costs: VirtualCosts):
        self.inner, self.costs = inner, costs
        self.model, self.mask_token_id, self.unmasked_steps = inner.model, inner.mask_token_id, inner.unmasked_steps

    def new_cache(self, num_rows: int, capacity: int):
        return self.inner.new_cache(num_rows, capacity)

    def forward(self, input_ids, *args, **kwargs):
        self.costs.charge(input_ids.numel())
        return self.inner.forward(input_ids, *args, **kwargs)


def _strip(ids: list[int], pad: int, eos: list[int]) -> list[int]:
    """New tokens up to and including the first EOS."""
    out = []
    for t in ids:
        out.append(t)
        if t in eos:
            break
    while out and out[-1] == pad and pad not in eos:
        out.pop()
    return out


class ForwardCounter:
    """Counts a module's forward calls (HF's loops expose no statistics of their own)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._count) if module is not None else None

    def _count(self, module, args):
        self.calls += 1

    def remove(self):
        if self.handle is not None:
            self.handle.remove()


def run_hf(model, tokenizer, prompts: list[str], c: int, max_new: int, method: str = "ar", assistant=None,
           virtual: VirtualCosts | None = None) -> dict:
    """Plain HF generate (also with a static cache, and compiled), prompt lookup or assisted generation, in static
    batches of c, or continuous batching (`hf-cb`, a closed loop of c); per-request latency = its batch's time.
    Assisted methods also count verifier forwards (prefill excluded) and draft forwards.
    With `virtual` (plain `ar` only), times are the cost model's charges for the forwards HF ran."""
    if virtual is not None:
        if parse_method(method)[0] != "ar":
            raise ValueError(f"{method} has no virtual cost model (its draft model's forwards are not priced)")
        virtual.now = 0.0
        with virtual.charging(model):
            return _run_hf(model, tokenizer, prompts, c, max_new, method, assistant, clock=virtual.perf_counter)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    run = _run_hf(model, tokenizer, prompts, c, max_new, method, assistant)
    # HF's compiled forward (ar-compile) compiles where it meets a new shape; its seconds are not separable from
    # the pass, so a pass that compiled anything counts whole as compiling (and the bench runs it again)
    run["compile_s"] = run["wall"] if counters["stats"]["unique_graphs"] != graphs else 0.0
    return run


def _run_hf(model, tokenizer, prompts, c, max_new, method, assistant, clock=time.perf_counter) -> dict:
    base, overrides = parse_method(method)
    if base == "hf-cb":
        return _run_cb(model, tokenizer, prompts, c, max_new)
    pad = tokenizer.pad_token_id
    eos = [model.generation_config.eos_token_id]
    kw = {}
    if base == "ar-static":
        kw = dict(cache_implementation="static")
    elif base == "ar-compile":
        kw = ar_compile_kwargs()
    elif base == "hf-lookup":
        kw = dict(prompt_lookup_num_tokens=10)
    elif base == "hf-assisted":
        if assistant is None:
            raise ValueError("hf-assisted needs a draft model (recguide bench --assistant DIR)")
        kw = dict(assistant_model=assistant)
    saved = assistant.generation_config if assistant is not None else None
    if base == "hf-assisted":  # this method's schedule on a copy: the next method sees HF's defaults again
        assistant.generation_config = copy.deepcopy(saved)
        assistant.generation_config.update(**{k: _number(v) for k, v in overrides.items()})
    verifier, drafter = ForwardCounter(model if base in BATCH_ONE else None), ForwardCounter(kw.get("assistant_model"))
    records = []
    start = clock()
    try:
        for i in range(0, len(prompts), c):
            enc = tokenizer(prompts[i:i + c], return_tensors="pt", padding=True)
            t0 = clock()
            # HF's own generate (what recguide_mode="ar" runs), also for models without the folder's custom generate
            out = GenerationMixin.generate(model, **enc, max_new_tokens=max_new, do_sample=False, **kw)
            lat = clock() - t0
            # [:max_new]: transformers 5.0's prompt lookup returns up to a few tokens past max_new_tokens (its
            # first max_new equal greedy's); later versions stop there, and no method is credited extra tokens
            for row in out[:, enc["input_ids"].shape[1]:][:, :max_new].tolist():
                ids = _strip(row, pad, eos)
                records.append({"new_ids": ids, "new_tokens": len(ids), "latency": lat})
    finally:
        verifier.remove()
        drafter.remove()
        if saved is not None:
            assistant.generation_config = saved
    wall = clock() - start
    counts = None
    if base in BATCH_ONE:  # one prefill per generate call; every later verifier call verifies one round
        counts = {"verifier_forwards": verifier.calls - len(records), "draft_forwards": drafter.calls}
    return {"records": records, "wall": wall, "engine_stats": None, "hf_counts": counts}


def cb_settings(model, ids: list[list[int]], slots: int, max_new: int):
    """(generation config, ContinuousBatchingConfig) for HF's continuous batching of these prompts, `slots`
    requests decoding at once, greedy."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as err:
        raise ValueError("hf-cb needs a transformers with ContinuousBatchingConfig (5.24 has it, 5.0 not)") from err
    gen = copy.deepcopy(model.generation_config)
    gen.update(max_new_tokens=max_new, do_sample=False)
    pages = -(-(max(map(len, ids)) + max_new) // 256) + 1  # 256-token pages per request, one spare
    # tokens per step: HF's default (8192) sizes [M, M + cache] attention masks that at C = 64 asked for more memory
    # than this 24 GiB machine offers; a prompt longer than this is prefilled in chunks
    batch_tokens = max(1024, max(map(len, ids)) + slots)
    return gen, ContinuousBatchingConfig(max_requests_per_batch=slots, num_blocks=slots * pages,
                                         max_batch_tokens=batch_tokens)


def _run_cb(model, tokenizer, prompts: list[str], c: int, max_new: int) -> dict:
    """HF's continuous batching (`generate_batch`), at most c requests decoding at once (a closed loop of c). Each
    request's latency runs from its admission to its end, as the engine's does; `wall` spans the first admission
    to the last end, and the manager's start-up before it (cache allocation, warm-up) is `setup_s`, outside."""
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    gen, config = cb_settings(model, ids, c, max_new)
    start = time.perf_counter()
    out = model.generate_batch(inputs=ids, generation_config=gen, continuous_batching_config=config)
    total = time.perf_counter() - start
    results = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    if len(results) != len(ids) or any(o.error for o in results):
        raise RuntimeError(f"continuous batching returned {len(results)} of {len(ids)} requests, errors: "
                           f"{[o.error for o in results if o.error]}")
    eos = [model.generation_config.eos_token_id]
    records = [{"new_ids": _strip(o.generated_tokens[:max_new], tokenizer.pad_token_id, eos),
                "latency": o.lifespan[1] - o.lifespan[0]} for o in results]
    for r in records:
        r["new_tokens"] = len(r["new_ids"])
    wall = max(o.lifespan[1] for o in results) - min(o.lifespan[0] for o in results)
    return {"records": records, "wall": wall, "engine_stats": None, "hf_counts": None, "setup_s": total - wall}


def _number(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def run_engine(model, tokenizer, prompts: list[str], c: int, max_new: int, method: str | DecodingConfig,
               virtual: VirtualCosts | None = None, virtual_table: str | None = None, phases=None) -> dict:
    """One closed-loop run of C slots; `method` is a bench method name or a `DecodingConfig`. The result keeps the
    engine (its policy's observations, e.g. branch segments per row). With `virtual`, the engine's clock is the
    cost model's and recguide plans with `virtual_table` (`VirtualCosts.cost_table`, written to a file).
    `phases`: the engine's timing seam (phases.py; a profiler's `PhaseClock`)."""
    gen_config = model.generation_config
    config = method if isinstance(method, DecodingConfig) else _engine_config(method, gen_config)
    if virtual is not None and config.mode == "recguide":
        config = dataclasses.replace(config, cost_table=virtual_table)
    eos = gen_config.eos_token_id
    settings = SamplingSettings(max_new_tokens=max_new, eos_token_ids=[eos] if isinstance(eos, int) else list(eos),
                                pad_token_id=tokenizer.pad_token_id)
    backbone = as_backbone(model) if virtual is None else virtual.charged(as_backbone(model))
    engine = Engine(backbone, config, settings, base_dir=getattr(model.config, "_name_or_path", None),
                    clock=virtual.perf_counter if virtual is not None else time.perf_counter, phases=phases)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if virtual is not None:
        virtual.now = 0.0
        records = engine.serve(ids, slots=c)
        wall = virtual.now
    else:
        start = time.perf_counter()
        records = engine.serve(ids, slots=c)
        wall = time.perf_counter() - start
    stats = engine.slots.stats
    return {"records": records, "wall": wall, "engine": engine, "compile_s": engine.compile_warmup_s or 0.0,
            "engine_stats": {"forwards": stats.total_forwards, "query_tokens": stats.total_query_tokens},
            "bucket_rounds": dict(stats.bucket_rounds)}


def pricing_table(model) -> CostTable | None:
    """The cost table the model's recguide plans with (its generation config's, read from its folder), to price every
    engine run's rounds by (`summarize`); None where it names none."""
    config = _engine_config("recguide", model.generation_config)
    return cost_table_of(config, getattr(model.config, "_name_or_path", None))


def summarize(run: dict, reference: dict[int, list[int]] | None, costs: CostTable | None = None) -> dict:
    """One run's figures. With `costs`, an engine run also gets `table_priced_tps`: its tokens over its decode rounds
    at the table's prices (each bucket round at `CostTable.round_cost`: a LinearSS round without branches; prefills
    left out), the worth of its decisions with the host's drift and noise taken out, comparable between engine
    methods of one run (not with HF's methods, which have no rounds, nor with aggregate tok/s)."""
    recs = run["records"]
    tokens = sum(r["new_tokens"] for r in recs)
    out = {
        "aggregate_tps": tokens / run["wall"],
        "per_request_tps": statistics.mean(r["new_tokens"] / r["latency"] for r in recs if r["latency"] > 0),
        "new_tokens": tokens, "wall_s": run["wall"], "num_requests": len(recs),
    }
    if costs is not None and run.get("bucket_rounds"):
        out["table_priced_tps"] = tokens / costs.price(run["bucket_rounds"])
    if run.get("hf_counts"):  # HF assisted: one verifier forward per round
        fwd = run["hf_counts"]["verifier_forwards"]
        out.update(tpf=tokens / fwd if fwd else 0.0, tau=tokens / fwd if fwd else 0.0, rounds=fwd,
                   draft_forwards=run["hf_counts"]["draft_forwards"])
    if "forwards" in recs[0]:
        fwd = sum(r["forwards"] for r in recs)
        rounds = sum(r["rounds"] for r in recs)
        out.update(tpf=tokens / fwd if fwd else 0.0, tau=tokens / rounds if rounds else 0.0,
                   request_forwards=fwd, rounds=rounds, **(run["engine_stats"] or {}))
        mix: dict[int, int] = {}
        hits = {"correction_1": 0, "correction_2": 0, "continuation": 0}
        branch_rounds = 0
        for r in recs:
            for b, n in r["block_sizes"].items():
                mix[int(b)] = mix.get(int(b), 0) + n
            for k in hits:
                hits[k] += r["hits"][k]
            branch_rounds += r["branch_rounds"]
        total = sum(mix.values())
        out["block_mix"] = {str(b): n / total for b, n in sorted(mix.items())}
        out["hit_rates"] = {k: v / rounds for k, v in hits.items()} if rounds else {}
        out["coverage"] = sum(hits.values()) / rounds if rounds else 0.0
        out["branch_round_share"] = branch_rounds / rounds if rounds else 0.0
    if reference is not None:
        out["equal_to_ar"] = all(r["new_ids"] == reference[i] for i, r in enumerate(recs))
    if "setup_s" in run:
        out["setup_s"] = run["setup_s"]
    if run.get("compile_s"):  # compiled inside a timed pass even after two re-runs: its seconds are in the wall
        out["compile_in_timing_s"] = run["compile_s"]
    return out


def environment(command: str) -> dict:
    import transformers

    try:
        here = Path(__file__).parents[1]  # the package's folder
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here).stdout.strip() or "unknown"
        # the package's own files changed since that commit: the run measured code no commit holds
        changed = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                                 cwd=here).stdout.strip()
        if changed and commit != "unknown":
            commit += "+uncommitted"
    except OSError:
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU: {cpu}"
    return {"hardware": hardware, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": transformers.__version__, "git_commit": commit,
            "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def save_run(path: Path | None, payload: dict) -> dict:
    """An eval script's JSON record: `payload` plus the command line that ran and `environment`, written to
    `path` (None: not written). Returns the record."""
    command = "python " + " ".join(sys.argv)
    record = payload | {"command": command, "environment": environment(command)}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def bench(model, tokenizer, prompts: list[str], methods=METHODS, concurrencies=(1, 2, 4, 8, 16, 32, 64),
          max_new_tokens: int = 64, repeats: int = 3, prompts_per_slot: int = 2, min_prompts: int = 48,
          progress=None, plain_model=None, assistant=None, virtual: VirtualCosts | None = None,
          virtual_table: str | None = None) -> dict:
    """Run every (repeat, C, method), interleaved; return per (method, C) medians and the raw runs.

    `plain_model`: the verifier alone, for the HF methods and the reference outputs (default: `model`);
    `assistant`: the draft model of `hf-assisted`; `virtual` / `virtual_table`: a simulation (`VirtualCosts`)."""
    plain = plain_model if plain_model is not None else model
    for m in methods:
        parse_method(m)
    # engine runs priced by the cost table recguide plans with (a simulation's clock is a cost model already)
    costs = pricing_table(model) if virtual is None else None
    raw: dict[tuple[str, int], list[dict]] = {}
    warmup: dict[tuple[str, int], float] = {}  # compiling methods: seconds of the untimed first pass per C
    reference: dict[int, list[int]] = {}
    n_max = min(len(prompts), max(max(concurrencies) * prompts_per_slot, min_prompts))
    # reference outputs: plain HF greedy at batch 1 (untimed), one per prompt
    for i, p in enumerate(prompts[:n_max]):
        ref = run_hf(plain, tokenizer, [p], 1, max_new_tokens)
        reference[i] = ref["records"][0]["new_ids"]
        if progress is not None:
            progress.set_description("reference outputs")

    def timed_run(m: str, c: int, n: int) -> dict:
        if parse_method(m)[0] in HF_METHODS:
            return run_hf(plain, tokenizer, prompts[:n], c, max_new_tokens, m, assistant, virtual)
        return run_engine(model, tokenizer, prompts[:n], c, max_new_tokens, m, virtual, virtual_table)

    for rep in range(repeats):
        for c in concurrencies:
            n = min(len(prompts), max(c * prompts_per_slot, min_prompts))
            order = [m for m in methods if runs_at(m, c)]
            order = order[rep % len(order):] + order[:rep % len(order)]
            for m in order:
                if progress is not None:
                    progress.set_description(f"repeat {rep + 1}/{repeats} C={c} {m}")
                if compiles(m) and (m, c) not in warmup:
                    # compiling is excluded from the timing: one untimed pass over the same requests first
                    # (every shape they need gets compiled), its time reported beside the row
                    first = (run_hf(plain, tokenizer, prompts[:n], c, max_new_tokens, m) if parse_method(m)[0]
                             in HF_METHODS else run_engine(model, tokenizer, prompts[:n], c, max_new_tokens, m))
                    warmup[(m, c)] = first["wall"]
                run = timed_run(m, c, n)
                for _ in range(2):  # a timed pass that compiled a graph the warm-up did not meet (closed-loop serving
                    if not run.get("compile_s"):  # varies its buckets; HF's static cache is sized per batch) is
                        break  # warm-up too: run it again
                    warmup[(m, c)] = warmup.get((m, c), 0.0) + run["wall"]
                    run = timed_run(m, c, n)
                raw.setdefault((m, c), []).append(summarize(run, reference, costs))
                # the next run starts with this one's engine and caches freed, not still held by `run` (hundreds
                # of MB at 64 rows: a method timed after a larger one paid for its memory)
                run = None
                gc.collect()
                if progress is not None:
                    progress.update(1)
    rows = []
    for (m, c), runs in raw.items():
        row = {"method": m, "concurrency": c}
        for key in ("aggregate_tps", "per_request_tps", "wall_s"):
            row[key] = statistics.median(r[key] for r in runs)
        row["aggregate_tps_runs"] = [r["aggregate_tps"] for r in runs]  # per repeat, in repeat order
        if all("table_priced_tps" in r for r in runs):  # engine methods' rounds at table prices (`summarize`)
            row["table_priced_tps_runs"] = [r["table_priced_tps"] for r in runs]
            row["table_priced_tps"] = statistics.median(row["table_priced_tps_runs"])
        last = runs[-1]
        for key, value in last.items():
            if key not in row:
                row[key] = value
        row["equal_to_ar"] = all(r.get("equal_to_ar", True) for r in runs)
        if (m, c) in warmup:
            row["warmup_s"] = warmup[(m, c)]
        rows.append(row)
    rows.sort(key=lambda r: (_order_key(r["method"]), r["concurrency"]))
    settings = {"methods": list(methods), "concurrencies": list(concurrencies), "max_new_tokens": max_new_tokens,
                "repeats": repeats, "num_prompts": n_max}
    if virtual is not None:
        settings["virtual_costs"] = {"name": virtual.name, "file": str(virtual.path)}
    return {"rows": rows, "settings": settings}


def markdown_table(result: dict) -> str:
    warm = any("warmup_s" in r or "setup_s" in r for r in result["rows"])
    lines = ["| method | C | aggregate tok/s | per-request tok/s | TPF | tau | block mix | coverage | = AR |"
             + (" excluded s |" if warm else ""), "|---|---|---|---|---|---|---|---|---|" + ("---|" if warm else "")]
    for r in result["rows"]:
        mix = ", ".join(f"{b}:{v:.0%}" for b, v in r.get("block_mix", {}).items()) or "-"
        tpf = f"{r['tpf']:.2f}" if "tpf" in r else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        cov = f"{r['coverage']:.0%}" if "coverage" in r else "-"
        excluded = r.get("warmup_s", r.get("setup_s"))
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['aggregate_tps']:.1f} | {r['per_request_tps']:.1f} "
                     f"| {tpf} | {tau} | {mix} | {cov} | {'yes' if r['equal_to_ar'] else 'NO'} |"
                     + ((f" {excluded:.1f} |" if excluded is not None else " - |") if warm else ""))
    if warm:
        lines += ["", "excluded s: what the timing leaves out, the warm-up of a compiling method (ar-compile, "
                  "recguide:compile=true: an untimed first pass over the same requests, compiling every shape they "
                  "need; a timed pass that still compiled a graph, as closed-loop serving can meet a bucket the first "
                  "pass did not, counts as warm-up too and is run again) and hf-cb's start-up (its manager's cache "
                  "allocation and warm-up before the first request is admitted)."]
    return "\n".join(lines)


def adaptive_table(result: dict, method: str = "recguide") -> tuple[str, float | None]:
    """Per C: `method` vs the best fixed-block LinearSS (aggregate tokens/s), with its block mix.

    Returns the Markdown table and the mean ratio over the concurrencies where both ran (None if none).
    """
    by = {(r["method"], r["concurrency"]): r for r in result["rows"]}
    lines = [f"| C | best fixed LinearSS | its tok/s | {method} tok/s | ratio | {method} block mix (rounds) | = AR |",
             "|---|---|---|---|---|---|---|"]
    ratios = []
    for c in sorted({c for _, c in by}):
        fixed = [r for (m, cc), r in by.items() if cc == c and parse_method(m)[0] == "linear"]
        if not fixed or (method, c) not in by:
            continue
        best = max(fixed, key=lambda r: r["aggregate_tps"])
        ours = by[(method, c)]
        ratio = ours["aggregate_tps"] / best["aggregate_tps"]
        ratios.append(ratio)
        mix = ", ".join(f"B={b}: {v:.0%}" for b, v in ours.get("block_mix", {}).items())
        eq = "yes" if ours["equal_to_ar"] and best["equal_to_ar"] else "NO"
        lines.append(f"| {c} | {best['method']} | {best['aggregate_tps']:.1f} | {ours['aggregate_tps']:.1f} | "
                     f"x{ratio:.2f} | {mix} | {eq} |")
    mean = sum(ratios) / len(ratios) if ratios else None
    if mean is not None:
        lines.append(f"| mean | | | | x{mean:.2f} | | |")
    return "\n".join(lines), mean


def _paired(row: dict, other: dict) -> list[float]:
    """`row` / `other` in each repeat (empty without per-repeat figures). The two ran minutes apart at most within a
    repeat: the spread of these is the run's noise."""
    return [a / b for a, b in zip(row.get("aggregate_tps_runs", []), other.get("aggregate_tps_runs", []))]


def _listed(ratios: list[float]) -> str:
    """Per-repeat ratios as the tables print them ("" for none)."""
    return ", ".join(f"{x:.2f}" for x in ratios)


def against_fastest_other(rows: list[dict], method: str = "recguide",
                          peers: tuple[str, ...] | None = None, settings: bool = False) -> dict | None:
    """Of one concurrency's rows: `method`'s row against the fastest OTHER method there (`peers`: only methods of these
    bases), or None where either is missing. With `settings`, `ours` is the fastest of `method`'s own settings
    (`recguide`, `recguide:compile=true`, ...: one method, set up as a user may) and the others are the methods of
    other bases. `best`, `ratio`: by the run's median aggregate tokens/s; `paired`: the
    ratios within each repeat (empty without per-repeat figures); `best_top`, `ratio_top`: by each method's best
    repeat; `best_priced`, `priced`: the fastest other engine method at table prices (`summarize`) and the ratio
    there (None where the run has no table prices). `fastest_other_table` and the docs (eval/update_readme.py)
    both read it."""
    base = parse_method(method)[0]
    if settings:
        mine = [r for r in rows if parse_method(r["method"])[0] == base]
        ours = max(mine, key=lambda r: r["aggregate_tps"]) if mine else None
        rows = [r for r in rows if r is ours or parse_method(r["method"])[0] != base]
        method = ours["method"] if ours else method
    else:
        ours = next((r for r in rows if r["method"] == method), None)
    others = [r for r in rows if r["method"] != method and (peers is None or parse_method(r["method"])[0] in peers)]
    if ours is None or not others:
        return None

    def top(r):
        return max(r.get("aggregate_tps_runs") or [r["aggregate_tps"]])

    best, best_top = max(others, key=lambda r: r["aggregate_tps"]), max(others, key=top)
    best_priced = table_priced_best(rows, method)
    priced = (ours["table_priced_tps"] / best_priced["table_priced_tps"]
              if best_priced is not None and "table_priced_tps" in ours else None)
    return {"ours": ours, "best": best, "ratio": ours["aggregate_tps"] / best["aggregate_tps"],
            "paired": _paired(ours, best),
            "best_top": best_top, "ratio_top": top(ours) / top(best_top), "best_priced": best_priced, "priced": priced}


def fastest_other_table(result: dict, method: str = "recguide", peers: tuple[str, ...] | None = None,
                        label: str = "fastest other method", settings: bool = False) -> tuple[str, float | None]:
    """Per C: `method` vs the fastest OTHER method in the run (AR and every peer included; `peers`: only methods of
    these bases), aggregate tokens/s; with `settings`, the fastest of `method`'s own settings against the fastest
    method of another base (`against_fastest_other`), the setting named in its own column. A compiling method's
    warm-up, left out of its timing, is shown beside it.

    Returns the Markdown table and the smallest ratio over C (None if `method` did not run)."""
    by_c: dict[int, list[dict]] = {}
    for r in result["rows"]:
        by_c.setdefault(r["concurrency"], []).append(r)
    priced = any("table_priced_tps" in r for r in result["rows"] if r["method"] == method)
    lines = [f"| C | {label} | its tok/s | " + (f"{method} setting | " if settings else "") + f"{method} tok/s | ratio "
             "| ratio in each repeat | " + ("at table prices: fastest engine method | ratio | " if priced else "")
             + "= AR |", "|---|---|---|---|---|---|" + ("---|" if settings else "") + ("---|---|" if priced else "")
             + "---|"]
    ratios = []

    def named(row):
        return row["method"] + (f" (warm-up {row['warmup_s']:.0f} s excluded)" if "warmup_s" in row else "")

    for c in sorted(by_c):
        against = against_fastest_other(by_c[c], method, peers, settings)
        if against is None:
            continue
        ours, best = against["ours"], against["best"]
        ratios.append(against["ratio"])
        eq = "yes" if ours["equal_to_ar"] and best["equal_to_ar"] else "NO"
        paired = _listed(against["paired"])
        at_table = ""
        if priced:
            at_table = (f"{against['best_priced']['method']} | x{against['priced']:.3f} | "
                        if against["priced"] is not None else "- | - | ")
        setting = f"{named(ours)} | " if settings else ""
        lines.append(f"| {c} | {named(best)} | {best['aggregate_tps']:.1f} | {setting}{ours['aggregate_tps']:.1f} | "
                     f"x{against['ratio']:.2f} | {paired or '-'} | {at_table}{eq} |")
    return "\n".join(lines), (min(ratios) if ratios else None)


def table_priced_best(rows: list[dict], method: str = "recguide") -> dict | None:
    """Of one concurrency's rows, the other engine method whose rounds are the fastest at table prices (median over
    repeats, `summarize`), or None where none was priced."""
    priced = [r for r in rows if r["method"] != method and "table_priced_tps" in r]
    return max(priced, key=lambda r: r["table_priced_tps"]) if priced else None


def compile_rows(result: dict, method: str = "recguide") -> list[dict]:
    """Per C where both ran: `method` eager and compiled (`method:compile=true`) rows, the compiled / eager ratio,
    the warm-up and `repaid_tokens`, after which it is repaid: warm-up / (seconds per token eager - compiled), at
    the run's aggregate rates (None: never, or no warm-up recorded)."""
    compiled = f"{method}:compile=true"
    by = {(r["method"], r["concurrency"]): r for r in result["rows"]}
    out = []
    for c in sorted(c for m, c in by if m == compiled and (method, c) in by):
        eager, comp = by[(method, c)], by[(compiled, c)]
        saved = 1 / eager["aggregate_tps"] - 1 / comp["aggregate_tps"]  # seconds per token
        warm = comp.get("warmup_s")
        out.append({"concurrency": c, "eager": eager, "compiled": comp, "warmup_s": warm,
                    "ratio": comp["aggregate_tps"] / eager["aggregate_tps"],
                    "repaid_tokens": warm / saved if warm is not None and saved > 0 else None})
    return out


def compile_table(result: dict, method: str = "recguide") -> str | None:
    """Per C: `method` compiled (`method:compile=true`) against eager, with the warm-up and the tokens after which
    it is repaid (`compile_rows`). None: not run."""
    rows = compile_rows(result, method)
    if not rows:
        return None
    lines = [f"| C | {method} (eager) tok/s | {method}:compile=true tok/s | ratio | ratio in each repeat | warm-up s | "
             "repaid after (tokens) | = AR |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eager, comp, warm = r["eager"], r["compiled"], r["warmup_s"]
        repaid = f"{r['repaid_tokens']:,.0f}" if r["repaid_tokens"] is not None else "never"
        eq = "yes" if eager["equal_to_ar"] and comp["equal_to_ar"] else "NO"
        lines.append(f"| {r['concurrency']} | {eager['aggregate_tps']:.1f} | {comp['aggregate_tps']:.1f} | "
                     f"x{r['ratio']:.2f} | {_listed(_paired(comp, eager)) or '-'} | "
                     f"{f'{warm:.0f}' if warm is not None else '-'} | {repaid} | {eq} |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'recguide-hf[eval]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict, out_dir: Path) -> list[Path]:
    """The frontier and TPF / tau plots (none, with a note, where matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        return []

    env = result.get("environment", {})
    footer = f"{env.get('hardware', '')} | torch {env.get('torch', '')} | commit {env.get('git_commit', '')}"
    virtual = result.get("settings", {}).get("virtual_costs")
    if virtual:  # the times are a cost model's, not this machine's
        footer = f"SIMULATION: forwards charged by {virtual['file']} ({virtual['name']}) | run on {footer}"
    by_method: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by_method.setdefault(r["method"], []).append(r)
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for m, rs in by_method.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        xs, ys = [r["per_request_tps"] for r in rs], [r["aggregate_tps"] for r in rs]
        ax.plot(xs, ys, marker="o", label=m)
        for r, x, y in zip(rs, xs, ys):
            ax.annotate(f"C={r['concurrency']}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("per-request tokens/s")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Concurrency frontier (greedy, closed loop)" + (", simulated GPU costs" if virtual else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.005, footer, fontsize=6)
    frontier = out_dir / "frontier.png"
    fig.savefig(frontier, dpi=130, bbox_inches="tight")
    plt.close(fig)

    engine_methods = [m for m in by_method if "tpf" in by_method[m][0]]
    cs = sorted({r["concurrency"] for r in result["rows"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(engine_methods), 1)
    for k, m in enumerate(engine_methods):
        rs = {r["concurrency"]: r for r in by_method[m]}
        xs = [i + k * width for i in range(len(cs))]
        axes[0].bar(xs, [rs[c]["tpf"] if c in rs else 0 for c in cs], width, label=m)
        axes[1].bar(xs, [rs[c]["tau"] if c in rs else 0 for c in cs], width, label=m)
    for ax, name in zip(axes, ("TPF (tokens per forward)", "tau (tokens per round)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cs))], [f"C={c}" for c in cs])
        ax.set_title(name)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.text(0.01, 0.005, footer, fontsize=6)
    tpf = out_dir / "tpf_tau.png"
    fig.savefig(tpf, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return [frontier, tpf]


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    env = result["environment"]
    md = [f"Command: `{env['command']}`", "",
          f"Hardware: {env['hardware']} ({env['threads']} threads); torch {env['torch']}, transformers "
          f"{env['transformers']}; commit {env['git_commit']}; {env['date']}", "", markdown_table(result), ""]
    assisted = [r for r in result["rows"] if parse_method(r["method"])[0] == "hf-assisted"]
    if any(parse_method(r["method"])[0] in BATCH_ONE for r in result["rows"]):
        md += ["HF assisted generation (hf-lookup, hf-assisted) is batch 1 only: it runs at C = 1 and is n/a beyond. "
               "Its TPF and tau are tokens per verifier forward (one per round)"
               + "".join(f"; {r['method']} also ran {r['draft_forwards'] / r['new_tokens']:.2f} draft-model "
                         "forwards per token" for r in assisted) + ".", ""]
    table, low = fastest_other_table(result)
    if low is not None:
        md += ["RecGuide (default settings) against the fastest other method at each concurrency:", "", table, ""]
    table, low = fastest_other_table(result, peers=HF_AR, label="fastest HF autoregressive method")
    if low is not None:
        md += ["RecGuide (default settings) against HF's fastest autoregressive decoding at each concurrency (plain, "
               "static cache, static cache + compiled forward, continuous batching; warm-up excluded):", "", table,
               ""]
    table = compile_table(result)
    if table is not None:
        md += ["RecGuide compiled (`recguide_compile=true`) against eager. The warm-up is its untimed first pass over "
               "the same requests at that C; graphs compiled at an earlier C of the run are reused, and torch's "
               "on-disk compile cache may hold kernels of earlier processes, so a cold start costs more. At these "
               "rates the warm-up is repaid once a process has decoded the tokens in 'repaid after':", "",
               table, ""]
    table, mean = adaptive_table(result)
    if mean is not None:
        md += ["RecGuide (auto block size) against the best fixed-block LinearSS at each concurrency:", "", table, ""]
    (out_dir / "bench.md").write_text("\n".join(md))
    return [out_dir / "bench.json", out_dir / "bench.md", *plot(result, out_dir)]
