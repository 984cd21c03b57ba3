"""Decoding options: one frozen dataclass, validated once, built from a `GenerationConfig` in one place.

Every option is a `recguide_*` key that can live in `generation_config.json`, in a passed
`GenerationConfig`, or be given per call (`model.generate(..., recguide_block_size=8)`, and so lm-eval's
`--gen_kwargs`). Precedence: per-call keyword > GenerationConfig attribute > default below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MODES = ("ar", "linear", "recguide")
OVERLAPS = ("fused", "streams", "off")
FIRST_DRAFTS = ("mask", "verifier")
MIN_BLOCK, MAX_BLOCK = 1, 64  # B = 1: a plain decoding step (no draft forward)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)  # what `recguide profile` measures by default
PAPER_BLOCK_SIZES = (8, 16, 32)  # the paper's candidates (an 8B model on a B200)


@dataclass(frozen=True)
class DecodingConfig:
    """How RecGuide decodes. See docs/algorithm.md §2 for the algorithm each field controls."""

    mode: str = "recguide"  # "ar": plain HF generation; "linear": LinearSS; "recguide": overlap + adaptive
    block_size: int | str = 16  # B = seed + B-1 drafts; "auto" = chosen per request and round
    # candidates for "auto"; None = every block size the cost table measured (PAPER_BLOCK_SIZES without one)
    block_sizes: tuple[int, ...] | None = None
    delta: float = 0.5  # a draft position is risky when its top-2 draft margin is below delta
    max_corrections: int = 2  # correction branches per round; later ones rarely pay (docs/algorithm.md §2.4)
    continuation: bool = True  # also draft the block after a fully accepted one
    overlap: str = "fused"  # branches in the verify forward: one fused call, a 2nd CUDA stream, or off
    cost_table: str | None = None  # measured forward costs (`recguide profile`); None = never drop branches
    value_table: str | None = None  # calibrated V_B(s, z) (`recguide calibrate`), used by "auto"
    rho: float | None = None  # cost weight in the "auto" policy; None = from the cost table
    # where d_1 comes from: "mask" (docs/algorithm.md §2.1: the first mask position, like every other draft) or
    # "verifier" (the seed's own next-token logits, computed causally with the base weights inside the draft
    # forward: the verifier's prediction, so a greedy d_1 is always accepted)
    first_draft: str = "mask"
    # "auto" only: correct each block size's cost-table price by the round times this call measures (the
    # table comes from static batches at one prefix length; serving differs). False: the table alone, and
    # block choices (so sampled output for a seed) independent of the machine's timing
    online_costs: bool = True
    # how far a block size not run yet in this call reads cheaper than the table (a log-price discount that
    # fades as its rounds are measured; 0: none), and the table's weight in rounds of pseudo-evidence
    online_optimism: float = 0.03
    online_prior: float = 8.0
    # "auto" only: correct the value table by the drafts this call's rounds accept (the table was fitted on the
    # calibration prompts; served prompts accept more or less). False: the table alone
    online_values: bool = True
    # the backbone's forward through torch.compile (compiled.py; CUDA graphs on CUDA). Eager is the reference
    # and the default until a bench shows compiling pays; the compile time is reported (`compile_warmup_s`)
    compile: bool = False

    def __post_init__(self):
        _check(self.mode in MODES, "recguide_mode", self.mode, f"one of {MODES}")
        _check(self.overlap in OVERLAPS, "recguide_overlap", self.overlap, f"one of {OVERLAPS}")
        _check(self.first_draft in FIRST_DRAFTS, "recguide_first_draft", self.first_draft, f"one of {FIRST_DRAFTS}")
        if isinstance(self.block_size, str):
            _check(self.block_size == "auto", "recguide_block_size", self.block_size,
                   f'an integer from {MIN_BLOCK} to {MAX_BLOCK} or "auto"')
        else:
            _check(_is_int(self.block_size) and MIN_BLOCK <= self.block_size <= MAX_BLOCK, "recguide_block_size",
                   self.block_size, f'an integer from {MIN_BLOCK} to {MAX_BLOCK} or "auto"')
        sizes = self.block_sizes
        _check(sizes is None or (isinstance(sizes, tuple) and len(sizes) > 0
                                 and all(_is_int(b) and MIN_BLOCK <= b <= MAX_BLOCK for b in sizes)),
               "recguide_block_sizes", sizes, f"a non-empty list of integers from {MIN_BLOCK} to {MAX_BLOCK}")
        _check(isinstance(self.delta, (int, float)) and not isinstance(self.delta, bool) and 0 < self.delta <= 1,
               "recguide_delta", self.delta, "a number with 0 < delta <= 1")
        _check(_is_int(self.max_corrections) and 0 <= self.max_corrections <= 2, "recguide_max_corrections",
               self.max_corrections, "0, 1 or 2")
        _check(isinstance(self.continuation, bool), "recguide_continuation", self.continuation, "true or false")
        _check(isinstance(self.online_costs, bool), "recguide_online_costs", self.online_costs, "true or false")
        _check(isinstance(self.online_values, bool), "recguide_online_values", self.online_values, "true or false")
        _check(isinstance(self.compile, bool), "recguide_compile", self.compile, "true or false")
        _check(_is_number(self.online_optimism) and 0 <= self.online_optimism <= 1, "recguide_online_optimism",
               self.online_optimism, "a number from 0 to 1")
        _check(_is_number(self.online_prior) and self.online_prior > 0, "recguide_online_prior", self.online_prior,
               "a number > 0")
        _check(self.rho is None or (isinstance(self.rho, (int, float)) and self.rho >= 0), "recguide_rho",
               self.rho, "a number >= 0 or None")

    @property
    def branches_enabled(self) -> bool:
        return self.mode == "recguide" and self.overlap != "off" and (self.max_corrections > 0 or self.continuation)

    @classmethod
    def from_sources(cls, generation_config=None, **overrides) -> DecodingConfig:
        """Merge `recguide_*` attributes of a GenerationConfig with per-call overrides (None = unset)."""
        values = {}
        if generation_config is not None:
            for key, value in vars(generation_config).items():
                if key.startswith("recguide_"):
                    values[key] = value
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f"recguide_{f.name}" for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown setting(s) {unknown}; RecGuide settings are {sorted(known)}")
        kwargs = {key[len("recguide_"):]: _coerce(key, value) for key, value in values.items()}
        return cls(**kwargs)


def _coerce(key: str, value):
    """Accept the string forms that lm-eval's --gen_kwargs and JSON files produce."""
    if key == "recguide_block_sizes":
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").replace("[", " ").replace("]", " ").split()]
        if isinstance(value, (list, tuple)):
            return tuple(_maybe_int(v) for v in value)
        return value
    if key == "recguide_block_size" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    switches = ("recguide_continuation", "recguide_online_costs", "recguide_online_values", "recguide_compile")
    if key in switches and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    numbers = ("recguide_delta", "recguide_rho", "recguide_online_optimism", "recguide_online_prior")
    if key in numbers and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if key == "recguide_max_corrections" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def _maybe_int(v):
    return int(v) if isinstance(v, str) and v.strip().isdigit() else v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(ok: bool, name: str, value, allowed: str):
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")


ALL_KEYS = tuple(f"recguide_{f.name}" for f in dataclasses.fields(DecodingConfig))
