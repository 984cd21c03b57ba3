"""Open-loop serving measurement (`recguide bench --arrivals ...`): what users feel while load changes.

Requests arrive by a seeded trace whatever the server does, as vLLM's `benchmark_serving` replays them, and every
method gets the same arrivals and prompts, so what differs is what each request feels. (A closed loop holding C
requests measures capacity; this measures latency under a load that comes and goes.)

Traces (arrival times in seconds, seeded; the run writes the one it used to `trace.json`):
* `poisson:RATE,N`: N requests, exponential gaps at RATE per second;
* `bursty:LOW,HIGH,SECONDS`: a Poisson process whose rate holds at LOW, climbs to HIGH, holds, falls back to LOW
  and holds (quarters, eighths, a quarter, an eighth, a quarter of SECONDS), so requests in flight swing from about
  one to many and back within one run (the rates that do that depend on the hardware's speed: see docs/serving.md).

Methods: engine methods (`linear-N`, `recguide...`; `linear-1` is the engine's plain decoding steps, i.e. plain
autoregressive decoding in the same continuous batching) run in the engine's requests-as-they-come interface,
`slots` rows at most, the rest queued; `hf-cb` is HF's own continuous batching manager fed at the arrival times
(wall clock only: its scheduler runs on its own thread, so a simulated clock cannot drive it).

Per request (vLLM's definitions): TTFT = first token - arrival; TPOT = (last - first token) / (tokens - 1); ITL =
gaps between a request's emissions (a speculative round's burst is one emission: reported per chunk, and per
token with each gap spread over the chunk's tokens); decoding speed = output tokens / (last - first token). Under
`--virtual-costs` the arrival clock is the simulated clock: a round advances it by the cost model's price of its
forwards, and an idle engine jumps to the next arrival.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from pathlib import Path

from ..core.engine import Engine, SamplingSettings
from ..models.registry import as_backbone
from .bench import VirtualCosts, _engine_config, _strip, cb_settings, parse_method, pyplot


# ---------------------------------------------------------------- traces
def poisson_trace(rate: float, n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def bursty_rate(t: float, low: float, high: float, seconds: float) -> float:
    """The bursty trace's rate at time t: low, a climb, high, a fall, low (1/4, 1/8, 1/4, 1/8, 1/4 of the run)."""
    x = t / seconds
    if x < 0.25 or x >= 0.75:
        return low
    if x < 0.375:
        return low * (high / low) ** ((x - 0.25) / 0.125)  # geometric: load grows by a factor, not a step
    if x < 0.625:
        return high
    return high * (low / high) ** ((x - 0.625) / 0.125)


def bursty_trace(low: float, high: float, seconds: float, seed: int = 0) -> list[float]:
    """A non-homogeneous Poisson process at `bursty_rate`, by thinning (Lewis and Shedler)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(high)
        if t >= seconds:
            return out
        if rng.random() < bursty_rate(t, low, high, seconds) / high:
            out.append(t)


def parse_arrivals(spec: str, seed: int = 0) -> tuple[list[float], dict]:
    """`poisson:RATE,N` or `bursty:LOW,HIGH,SECONDS` -> (arrival times, a description)."""
    kind, _, rest = spec.partition(":")
    try:
        values = [float(v) for v in rest.split(",")] if rest else []
    except ValueError:
        values = None
    if kind == "poisson" and values and len(values) == 2 and values[0] > 0 and values[1] >= 1:
        return poisson_trace(values[0], int(values[1]), seed), {"kind": kind, "rate": values[0], "n": int(values[1]),
                                                                 "seed": seed}
    if kind == "bursty" and values and len(values) == 3 and 0 < values[0] <= values[1] and values[2] > 0:
        low, high, seconds = values
        return bursty_trace(low, high, seconds, seed), {"kind": kind, "low": low, "high": high, "seconds": seconds,
                                                        "seed": seed}
    raise ValueError(f"--arrivals {spec!r}: expected poisson:RATE,N or bursty:LOW,HIGH,SECONDS (rates per second)")


# ---------------------------------------------------------------- runs
@dataclasses.dataclass
class Timed:
    """One request's life in an open-loop run."""

    arrival: float
    prompt: int
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, tokens) per emission
    new_ids: list[int] = dataclasses.field(default_factory=list)
    done: float | None = None


def run_engine_open(model, tokenizer, pool: list[list[int]], arrivals: list[float], max_new: int, method: str,
                    slots: int, virtual: VirtualCosts | None = None, virtual_table: str | None = None,
                    policy=None) -> dict:
    """Replay `arrivals` (request k asks for prompt `pool[k % len(pool)]`) into the engine's continuous batching.
    `policy`: a block-size scheduler in place of the method's own (eval/open_loop_ceiling.py's load oracle)."""
    gen_config = model.generation_config
    config = _engine_config(method, gen_config)
    if virtual is not None and config.mode == "recguide":
        config = dataclasses.replace(config, cost_table=virtual_table)
    eos = gen_config.eos_token_id
    settings = SamplingSettings(max_new_tokens=max_new, eos_token_ids=[eos] if isinstance(eos, int) else list(eos),
                                pad_token_id=tokenizer.pad_token_id)
    clock = virtual.perf_counter if virtual is not None else time.perf_counter
    backbone = as_backbone(model) if virtual is None else virtual.charged(as_backbone(model))
    engine = Engine(backbone, config, settings, policy=policy, base_dir=getattr(model.config, "_name_or_path", None),
                    clock=clock)
    engine.open(slots, max(map(len, pool)))
    reqs = [Timed(a, k % len(pool)) for k, a in enumerate(arrivals)]
    timeline: list[tuple[float, int, dict[int, int]]] = []  # (time, requests in flight, rows per block size)
    if virtual is not None:
        virtual.now = 0.0
    _replay(engine, pool, reqs, timeline, clock, virtual)
    return {"requests": reqs, "timeline": timeline}


def _replay(engine: Engine, pool, reqs: list[Timed], timeline, clock, virtual):
    start, nxt, n = clock(), 0, len(reqs)
    while nxt < n or engine.num_running or engine.num_waiting:
        now = clock() - start
        while nxt < n and reqs[nxt].arrival <= now:
            engine.submit(nxt, pool[reqs[nxt].prompt])
            nxt += 1
        if not (engine.num_running or engine.num_waiting):  # idle: the next request arrives
            if virtual is not None:
                virtual.now = start + reqs[nxt].arrival
            else:
                time.sleep(max(0.0, reqs[nxt].arrival - now))
            continue
        in_flight = engine.num_running + engine.num_waiting
        events = engine.step()
        t = clock() - start
        timeline.append((t, in_flight, dict(engine.last_round)))
        for e in events:
            r = reqs[e.request_id]
            if e.new_ids:
                r.chunks.append((t, len(e.new_ids)))
                r.new_ids.extend(e.new_ids)
            if e.finished:
                r.done = t


def run_hf_cb_open(model, tokenizer, pool: list[list[int]], arrivals: list[float], max_new: int, slots: int) -> dict:
    """HF's continuous batching manager, each request added at its arrival time (wall clock)."""
    gen, config = cb_settings(model, pool, slots, max_new)
    reqs = [Timed(a, k % len(pool)) for k, a in enumerate(arrivals)]
    eos = [model.generation_config.eos_token_id]
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=config,
                                                   block=True, timeout=30) as manager:
        start = time.perf_counter()
        for k, r in enumerate(reqs):
            time.sleep(max(0.0, r.arrival - (time.perf_counter() - start)))
            manager.add_request(pool[r.prompt], request_id=f"req_{k}", max_new_tokens=max_new, record_timestamps=True)
        got = 0
        deadline = time.perf_counter() + 600
        while got < len(reqs) and time.perf_counter() < deadline:
            out = manager.get_result(timeout=1)
            if out is None or not out.is_finished():
                continue
            r = reqs[int(out.request_id.rsplit("_", 1)[-1])]
            r.new_ids = _strip(out.generated_tokens[:max_new], tokenizer.pad_token_id, eos)
            stamps = [s - start for s in (out.timestamps or [])][: len(r.new_ids)]
            r.chunks = [(s, 1) for s in stamps]
            r.done = stamps[-1] if stamps else out.lifespan[1] - start
            got += 1
    return {"requests": reqs, "timeline": []}


# ---------------------------------------------------------------- figures
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summarize_open(run: dict, reference: list[list[int]] | None) -> dict:
    reqs: list[Timed] = run["requests"]
    done = [r for r in reqs if r.done is not None and r.chunks]
    tokens = sum(len(r.new_ids) for r in done)
    span = max(r.done for r in done) - min(r.arrival for r in reqs) if done else float("nan")
    ttft = [r.chunks[0][0] - r.arrival for r in done]
    tpot = [(r.chunks[-1][0] - r.chunks[0][0]) / (len(r.new_ids) - 1) for r in done if len(r.new_ids) > 1]
    speed = [len(r.new_ids) / (r.chunks[-1][0] - r.chunks[0][0]) for r in done
             if r.chunks[-1][0] > r.chunks[0][0]]
    itl_chunk, itl_token = [], []
    for r in done:
        for (t0, _), (t1, k) in zip(r.chunks, r.chunks[1:]):
            itl_chunk.append(t1 - t0)
            itl_token += [(t1 - t0) / k] * k
    timeline = run.get("timeline") or []
    mix: dict[int, int] = {}
    for _, _, rows in timeline:
        for b, k in rows.items():
            mix[b] = mix.get(b, 0) + k
    total_rows = sum(mix.values())
    out = {
        "requests": len(reqs), "finished": len(done), "output_tokens": tokens, "output_tps": tokens / span,
        "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
        "tpot_p50": _pct(tpot, 0.5), "tpot_p99": _pct(tpot, 0.99),
        "itl_chunk_p50": _pct(itl_chunk, 0.5), "itl_chunk_p99": _pct(itl_chunk, 0.99),
        "itl_token_p50": _pct(itl_token, 0.5), "itl_token_p99": _pct(itl_token, 0.99),
        "decode_speed_mean": statistics.mean(speed) if speed else None,
        "max_in_flight": max((k for _, k, _ in timeline), default=None),
        "block_mix": {b: k / total_rows for b, k in sorted(mix.items())} if total_rows else {},
    }
    if reference is not None:
        out["equal_to_ar"] = all(r.new_ids == reference[r.prompt] for r in done) and len(done) == len(reqs)
    return out


def open_loop(model, tokenizer, prompts: list[str], methods: list[str], arrivals: list[float], max_new: int,
              slots: int, reference_model=None, virtual: VirtualCosts | None = None, virtual_table: str | None = None,
              progress=None, policies: dict | None = None) -> dict:
    """Every method on the same arrivals; returns per-method figures, timelines and latencies (for the plots).
    `policies`: {name: (engine method, block-size scheduler)} for methods that replace the engine method's own
    scheduler (eval/open_loop_ceiling.py's load oracles)."""
    policies = policies or {}
    from .bench import run_hf

    pool = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    plain = reference_model if reference_model is not None else model
    reference = [run_hf(plain, tokenizer, [p], 1, max_new)["records"][0]["new_ids"] for p in prompts]
    rows, raw = [], {}
    for m in methods:
        if progress is not None:
            progress.set_description(f"open loop: {m}")
        if m in policies:
            method, policy = policies[m]
            run = run_engine_open(model, tokenizer, pool, arrivals, max_new, method, slots, virtual, virtual_table,
                                  policy=policy)
        elif parse_method(m)[0] == "hf-cb":
            if virtual is not None:
                raise ValueError("hf-cb runs on the wall clock only; leave it out of a --virtual-costs run")
            run = run_hf_cb_open(plain, tokenizer, pool, arrivals, max_new, slots)
        else:
            run = run_engine_open(model, tokenizer, pool, arrivals, max_new, m, slots, virtual, virtual_table)
        rows.append({"method": m, **summarize_open(run, reference)})
        raw[m] = run
        if progress is not None:
            progress.update(1)
    return {"rows": rows, "runs": raw}


def best_single_other(rows: list[dict], ours: str = "recguide") -> dict | None:
    """The one fixed choice a user would have had to make for the whole trace: the other method with the highest
    mean per-request decoding speed."""
    others = [r for r in rows if parse_method(r["method"])[0] != ours and r.get("decode_speed_mean")]
    return max(others, key=lambda r: r["decode_speed_mean"]) if others else None


def markdown_open(rows: list[dict]) -> str:
    def f(v, scale=1.0, fmt="{:.0f}"):
        return "-" if v is None else fmt.format(v * scale)

    lines = ["| method | finished | output tok/s | decode speed (tok/s, mean) | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL per chunk p50 / p99 ms | ITL per token p50 / p99 ms | max in flight | block mix | = AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mix = ", ".join(f"{b}:{v:.0%}" for b, v in r["block_mix"].items()) or "-"
        lines.append(
            f"| {r['method']} | {r['finished']}/{r['requests']} | {r['output_tps']:.0f} | "
            f"{f(r['decode_speed_mean'], 1.0, '{:.1f}')} | {f(r['ttft_p50'], 1e3)} / {f(r['ttft_p99'], 1e3)} | "
            f"{f(r['tpot_p50'], 1e3, '{:.1f}')} / {f(r['tpot_p99'], 1e3, '{:.1f}')} | "
            f"{f(r['itl_chunk_p50'], 1e3, '{:.1f}')} / {f(r['itl_chunk_p99'], 1e3, '{:.1f}')} | "
            f"{f(r['itl_token_p50'], 1e3, '{:.1f}')} / {f(r['itl_token_p99'], 1e3, '{:.1f}')} | "
            f"{r['max_in_flight'] if r['max_in_flight'] is not None else '-'} | {mix} | "
            f"{'yes' if r.get('equal_to_ar') else 'NO'} |")
    return "\n".join(lines)


def describe(trace: dict) -> str:
    if trace["kind"] == "bursty":
        return (f"bursty arrivals: {trace['low']:g} -> {trace['high']:g} -> {trace['low']:g} requests/s over "
                f"{trace['seconds']:g} s, seed {trace['seed']}")
    return f"Poisson arrivals: {trace['rate']:g} requests/s, {trace['n']} requests, seed {trace['seed']}"


def verdict(rows: list[dict], ours: str = "recguide") -> str | None:
    mine = next((r for r in rows if parse_method(r["method"])[0] == ours), None)  # recguide, recguide:block_sizes=..
    best = best_single_other(rows, ours)
    if mine is None or best is None or not mine.get("decode_speed_mean"):
        return None
    speed = mine["decode_speed_mean"] / best["decode_speed_mean"]
    ttft = mine["ttft_p99"] / best["ttft_p99"] if best["ttft_p99"] else float("nan")
    return (f"{mine['method']} / {best['method']} (the best single other method by mean decoding speed): "
            f"decoding speed x{speed:.2f}, p99 TTFT x{ttft:.2f} (lower is better)")


def plot_open(result: dict, out_dir: Path) -> list[Path]:
    """Requests in flight over time (with recguide's rows per block size), and latency CDFs."""
    plt = pyplot()
    if plt is None:
        return []

    files = []
    runs = result["runs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for m, run in runs.items():
        if run["timeline"]:
            top.step([t for t, _, _ in run["timeline"]], [k for _, k, _ in run["timeline"]], where="post", label=m,
                     lw=1)
    top.set_ylabel("requests in flight")
    top.legend(fontsize=7, ncol=3)
    ours = next((m for m in runs if m.startswith("recguide") and runs[m]["timeline"]), None)
    if ours is not None:
        tl = runs[ours]["timeline"]
        blocks = sorted({b for _, _, rows in tl for b in rows})
        times = [t for t, _, _ in tl]
        stacks = [[rows.get(b, 0) for _, _, rows in tl] for b in blocks]
        bottom.stackplot(times, stacks, labels=[f"B={b}" for b in blocks], step="post")
        bottom.set_ylabel(f"{ours}: rows per block size")
        bottom.legend(fontsize=7, ncol=len(blocks))
    bottom.set_xlabel("seconds since the first arrival" + (" (simulated clock)" if result.get("virtual") else ""))
    fig.tight_layout()
    path = out_dir / "open_loop_in_flight.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m, run in runs.items():
        done = [r for r in run["requests"] if r.done is not None and r.chunks]
        for ax, values in ((axes[0], [r.chunks[0][0] - r.arrival for r in done]),
                           (axes[1], [(r.chunks[-1][0] - r.chunks[0][0]) / (len(r.new_ids) - 1) for r in done
                                      if len(r.new_ids) > 1])):
            values = sorted(v * 1e3 for v in values)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=m, lw=1)
    axes[0].set_xlabel("TTFT ms")
    axes[1].set_xlabel("TPOT ms")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "open_loop_latency_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    files.append(path)
    return files
