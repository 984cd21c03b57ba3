"""Data loaders and metrics for the local lm-eval tasks (`--include_path eval/tasks`).

Data paths resolve from this file, so the tasks work from any working directory. Nothing is downloaded:
the rows are read with `datasets` from JSON-lines files in this repository.

* recguide_stdlib_nextline: recguide_hf/bundled/prompts/heldout_code.jsonl (held-out CPython standard-library files,
  made by training/corpus.py), first `num_docs` rows (default 64).
* recguide_shakespeare_nextline: eval/tasks/data/shakespeare_nextline.jsonl (64 windows of the held-out play,
  made by eval/tasks/build_data.py).

Each row is {"prompt": 20 lines of text, "target": the next line}.

Prompt boundary. The byte-level BPE tokenizer merges a newline with the indentation that follows it ("\\n   " +
" def"), so a prompt that ends in "\\n" puts the model at a token boundary it never saw before an indented line
and it answers with a blank line. The code task therefore feeds the prompt without its trailing whitespace and
lets the model write the line break(s) and indentation itself: it generates `max_gen_toks` tokens (no stop
string) and the prediction is the line that follows the prompt's own trailing line breaks. Shakespeare's lines
start at column 0, where "\\n" is a natural boundary, so that task feeds the prompt verbatim and stops at "\\n".
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
CODE_FILE = HERE.parents[1] / "recguide_hf" / "bundled" / "prompts" / "heldout_code.jsonl"
PROSE_FILE = HERE / "data" / "shakespeare_nextline.jsonl"
DEFAULT_NUM_DOCS = 64


def _load(path: Path, num_docs=None, **_ignored):
    """A DatasetDict with one `test` split. Extra keyword arguments (lm-eval passes the model arguments and
    `--metadata` here) are ignored except `num_docs`."""
    import datasets

    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    n = DEFAULT_NUM_DOCS if num_docs is None else int(num_docs)
    if n > 0:
        ds = ds.select(range(min(n, len(ds))))
    return datasets.DatasetDict({"test": ds})


def load_stdlib_nextline(**kwargs):
    return _load(CODE_FILE, **kwargs)


def load_shakespeare_nextline(**kwargs):
    return _load(PROSE_FILE, **kwargs)


def doc_to_text(doc) -> str:
    return doc["prompt"]  # verbatim (Shakespeare task; stops at a line break)


def doc_to_text_stripped(doc) -> str:
    return doc["prompt"].rstrip()  # code task: the model writes the line break and indentation


def _next_line(prompt_tail: str, generation: str) -> str:
    """The line of `generation` that follows the prompt, given the whitespace `prompt_tail` cut off the prompt."""
    lines = generation.split("\n")
    k = prompt_tail.count("\n")
    return lines[k] if len(lines) > k else ""


def doc_to_target(doc) -> str:
    return doc["target"]


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)); 1.0 for two empty strings."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return 1.0 - prev[-1] / max(len(a), len(b))


def _scores(prediction: str, target: str) -> dict:
    prediction, target = prediction.strip(), target.strip()
    return {"exact_match": float(prediction == target), "edit_similarity": edit_similarity(prediction, target)}


def process_results(doc, results) -> dict:
    """Verbatim prompt: the first generated line against the target (both stripped)."""
    return _scores(results[0].split("\n", 1)[0], doc["target"])


def process_results_stripped(doc, results) -> dict:
    """Prompt fed without trailing whitespace: the line after the prompt's own line breaks against the target."""
    prompt = doc["prompt"]
    return _scores(_next_line(prompt[len(prompt.rstrip()):], results[0]), doc["target"])
