"""Prompts for self-distillation, made offline from text on this disk: Python's standard library.

A drafter learns what its verifier says after the prompts it will meet, so the prompt mix follows use: chat
instructions (for an instruct model, through its chat template) and raw code to continue. Both come from the
CPython standard library's sources (no tests), split by a hash of the file's path exactly as the project's corpus
is (training/corpus.py: 4% of files held out), so the held-out prompts come from files training never saw, the
same files the bundled held-out code prompts (`recguide_hf/bundled/prompts/`) were cut from. HumanEval is never
used for training.

Chat prompts, per function or class that has a docstring:
* "Write a Python function `name(args)` that <the docstring's first sentence>"
* "Explain what this Python function does:" + its source (short functions only)
* "What does the Python module `m` provide? Answer briefly." (module docstrings)
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from pathlib import Path

HELDOUT_PERCENT = 4
SKIP_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3")


def is_heldout(name: str) -> bool:
    """The corpus's split rule (training/corpus.py): held out iff sha256(name) % 100 < 4."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def stdlib_files(split: str) -> list[tuple[str, Path]]:
    """(path relative to the stdlib, file) of the stdlib's non-test sources in `split` ("train" or "heldout")."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIP_DIRS for p in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        name = str(path.relative_to(root))
        if is_heldout(name) == (split == "heldout"):
            out.append((name, path))
    return out


def _first_sentence(doc: str) -> str | None:
    line = " ".join(doc.strip().split("\n\n")[0].split())
    if not 12 <= len(line) <= 200 or line.startswith((">>>", "..")):
        return None
    sentence = line.split(". ")[0].rstrip(".")
    return sentence[0].lower() + sentence[1:] if sentence else None


def _signature(node: ast.FunctionDef) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if node.args.vararg:
        args.append("*" + node.args.vararg.arg)
    args += [a.arg for a in node.args.kwonlyargs]
    if node.args.kwarg:
        args.append("**" + node.args.kwarg.arg)
    return f"{node.name}({', '.join(args)})"


def chat_prompts(split: str, max_source_lines: int = 25) -> list[str]:
    """Instructions (plain text: the chat template is applied by the caller) from the stdlib files of `split`."""
    out = []
    for name, path in stdlib_files(split):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        module_doc = ast.get_docstring(tree)
        if module_doc and (what := _first_sentence(module_doc)):
            module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            out.append(f"What does the Python module `{module}` provide? It says: \"{what}\". Answer briefly.")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            doc = ast.get_docstring(node)
            what = _first_sentence(doc) if doc else None
            if what is None:
                continue
            out.append(f"Write a Python function `{_signature(node)}` that {what}.")
            body = lines[node.lineno - 1:node.end_lineno]
            if len(body) <= max_source_lines:
                indent = len(body[0]) - len(body[0].lstrip())
                code = "\n".join(line[indent:] for line in body)
                out.append(f"Explain what this Python function does:\n\n```python\n{code}\n```")
    return out


def code_windows(split: str, tokenizer, count: int, min_tokens: int = 48, max_tokens: int = 160,
                 seed: int = 0) -> list[str]:
    """`count` raw code prompts: random windows of the split's files, cut at line ends, to be continued."""
    rng = random.Random(seed)
    files = [p.read_text(encoding="utf-8", errors="replace") for _, p in stdlib_files(split)]
    files = [f for f in files if len(f) > 4000]
    out = []
    while len(out) < count:
        text = rng.choice(files)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(0, max(1, len(lines) - 40))
        window, size = [], 0
        budget = rng.randint(min_tokens, max_tokens)
        for line in lines[start:]:
            size += len(tokenizer(line, add_special_tokens=False)["input_ids"])
            window.append(line)
            if size >= budget:
                break
        if size >= min_tokens:
            out.append("".join(window))
    return out


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as the user's turn through the tokenizer's chat template, ready for the assistant's reply."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def prompt_mix(split: str, tokenizer, count: int, chat_share: float = 0.7, seed: int = 0) -> list[list[int]]:
    """`count` prompts as token ids: `chat_share` of them instructions through the tokenizer's chat template (when it
    has one), the rest raw code windows."""
    rng = random.Random(seed)
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    n_chat = round(count * chat_share) if has_chat else 0
    chats = chat_prompts(split)
    rng.shuffle(chats)
    out = [chat_prompt_ids(tokenizer, text) for text in chats[:n_chat]]
    out += [tokenizer(t, add_special_tokens=False)["input_ids"]
            for t in code_windows(split, tokenizer, count - len(out), seed=seed)]
    rng.shuffle(out)
    return out
