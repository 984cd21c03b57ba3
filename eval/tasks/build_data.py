"""Write eval/tasks/data/shakespeare_nextline.jsonl: 64 next-line windows from the held-out play.

The benchmark's recguide_hf/bundled/prompts/heldout_prose.jsonl has only 5 rows (one play, King Lear, is held out
and training/corpus.py takes at most 8 random windows per document), too few for an lm-eval task. This script takes
64 evenly spaced windows from the same held-out text: 20 lines of context, then the next non-blank line as
the target (the same shape as recguide_hf/bundled/prompts/heldout_*.jsonl). Deterministic; needs data/corpus from
training/corpus.py.

    python eval/tasks/build_data.py --corpus data/corpus
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTEXT_LINES = 20


def windows(text: str, n: int) -> list[dict]:
    lines = text.splitlines(keepends=True)
    last_start = len(lines) - CONTEXT_LINES - 1
    rows, seen = [], set()
    for i in range(n):
        start = i * last_start // n
        # move forward to the first window whose target line is not blank and whose context has text
        while start <= last_start and (not lines[start + CONTEXT_LINES].strip()
                                       or not "".join(lines[start:start + CONTEXT_LINES]).strip()):
            start += 1
        if start > last_start or start in seen:
            continue
        seen.add(start)
        rows.append({"prompt": "".join(lines[start:start + CONTEXT_LINES]),
                     "target": lines[start + CONTEXT_LINES].rstrip("\n"), "line": start + CONTEXT_LINES + 1})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--out", type=Path, default=HERE / "data" / "shakespeare_nextline.jsonl")
    args = parser.parse_args(argv)

    manifest = json.loads((HERE.parent / "data" / "corpus_manifest.json").read_text())
    heldout = [e["file"] for e in manifest["corpora"]["prose"]["files"] if e["split"] == "heldout"]
    docs = [json.loads(line)["text"] for line in open(args.corpus / "prose_heldout.jsonl")]
    rows = []
    for name, doc in zip(heldout, docs):
        for row in windows(doc, args.n // len(docs)):
            rows.append({"source": name, **row})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} windows from held-out {heldout} -> {args.out}")


if __name__ == "__main__":
    main()
