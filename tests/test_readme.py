"""The front door: every code block of README.md and the Quick start page runs as written, from a folder outside the
clone, non-interactively, on the bundled model.

Two kinds of block are not run here, each for a reason the test states and checks: installing (`pip install ...`:
it would change the environment under test; CI installs the same package from a clone with the CPU torch first, by
its own commands in `.ci/run`, not these lines) and the test command (`python -m pytest -q tests`: it runs the suite
this test is part of, in a clone). `text` blocks quote what a command printed; they are not commands. Every other
block runs: Python blocks as a script, shell blocks through bash, each in an empty folder with stdin closed. Known
models (`--model smollm2`) are fetched into the machine's own cache (`RECGUIDE_CACHE`, else ~/.cache/recguide), so
the download and conversion happen once per machine, not once per block.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recguide_hf import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/quickstart.md")
NOT_RUN = {  # a command a block may hold that this test does not run, and why
    "pip install": "installing: it would change the environment under test (CI installs by .ci/run's own commands)",
    "python -m pytest": "the test command: it runs this very suite, in a clone",
}

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(), reason="bundled weights missing")


def blocks(page: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of `page`, in order."""
    # fences at the start of a line: an indented block (a quoted output) may hold fences of its own
    return re.findall(r"^```(\w+)\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M)


def python_example() -> str:
    """README's "From Python" example (the first Python block)."""
    return next(code for lang, code in blocks("README.md") if lang == "python")


def skipped(code: str) -> bool:
    """Whether a shell block is one this test does not run: every command in it is one of `NOT_RUN`."""
    commands = [line.split("#")[0].strip() for line in code.splitlines()]
    commands = [c for c in commands if c]
    return bool(commands) and all(any(c.startswith(k) for k in NOT_RUN) for c in commands)


CASES = [(page, i, lang, code) for page in PAGES for i, (lang, code) in enumerate(blocks(page)) if lang != "text"]
CACHE = os.environ.get("RECGUIDE_CACHE", str(Path.home() / ".cache" / "recguide"))


def test_the_pages_have_blocks_and_only_the_stated_ones_are_not_run():
    """Each page shows the install, and README the test command; those and nothing else are the blocks not run."""
    not_run = [(page, code) for page, _, lang, code in CASES if lang == "bash" and skipped(code)]
    assert {page for page, _ in not_run} == set(PAGES)
    assert all(lang in ("bash", "python", "text") for page in PAGES for lang, _ in blocks(page))
    assert any(page == "README.md" and "python -m pytest" in code for page, code in not_run)
    assert sum(lang == "python" for _, _, lang, _ in CASES) >= 3  # README's example, Quick start's two


@pytest.mark.parametrize("page, index, lang, code", CASES, ids=[f"{p}#{i}" for p, i, _, _ in CASES])
def test_block_runs_from_outside_the_clone(page, index, lang, code, tmp_path):
    if lang == "bash" and skipped(code):
        pytest.skip(f"{page} block {index}: " + "; ".join(v for k, v in NOT_RUN.items() if k in code))
    # `recguide` and this Python on the PATH, nothing else; torch's threads as a reader's shell has them (a block that
    # sets OMP_NUM_THREADS itself sets it here too)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": str(tmp_path), "RECGUIDE_CACHE": CACHE,
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    if lang == "python":
        (tmp_path / "block.py").write_text(code)
        cmd = [sys.executable, str(tmp_path / "block.py")]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                         env=env)
    assert ROOT not in tmp_path.parents  # run outside the clone, as a reader would
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[y/N]" not in out.stdout + out.stderr and "custom code" not in out.stdout + out.stderr
    if lang == "python":
        assert out.stdout.strip(), "a Python block that prints nothing shows the reader nothing"


def test_readme_python_example_prints_texts_then_statistics(tmp_path):
    """README's example prints the two decoded texts, then TPF, tau and the branch hit rate (numbers)."""
    (tmp_path / "example.py").write_text(python_example())
    out = subprocess.run([sys.executable, str(tmp_path / "example.py")], cwd=tmp_path, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("[") and len(lines) == 2
    assert lines[1].split()[0].replace(".", "", 1).isdigit()


def test_the_documented_statistics_are_the_ones_generate_returns():
    """docs/generate.md's table of `recguide_stats` keys names exactly what a call returns (no key missing, none
    stale)."""
    import torch
    from transformers import AutoModelForCausalLM

    import recguide_hf

    page = (ROOT / "docs" / "generate.md").read_text().split("## What a call reports", 1)[1].split("\n## ", 1)[0]
    documented = {key for row in re.findall(r"^\| (`.*?) \|", page, re.M) for key in re.findall(r"`(\w+)`", row)}
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, trust_remote_code=True)
    out = recguide_hf.generate(model, input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4,
                               return_dict_in_generate=True, recguide_compile=False)
    returned = set(out.recguide_stats) | {"compile_warmup_s"}  # that key comes only from a compiling call
    assert documented == returned
