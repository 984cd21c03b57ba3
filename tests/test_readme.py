"""The README's front door: its Python example runs start to end, non-interactively, on the bundled model."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from recguide_hf import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[1]


def python_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(),
                    reason="bundled weights missing")
def test_python_example_runs_with_stdin_closed(tmp_path):
    """Pasted into a file in a folder outside the clone and run there: no interactive trust_remote_code prompt
    (stdin is closed, so a prompt would block or fail), exit 0, and it prints the decoded texts and the statistics
    it promises."""
    script = tmp_path / "example.py"
    script.write_text(python_example())
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[y/N]" not in out.stdout + out.stderr and "custom code" not in out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("[") and len(lines) == 2  # the two texts, then TPF, tau and the branch status
    assert lines[1].split()[0].replace(".", "", 1).isdigit()
