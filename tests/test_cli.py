"""The command line checks its arguments before it loads anything: one line naming the flag, exit status 2."""

import subprocess
import sys

import pytest

CHECK = r'''
import sys
from recguide_hf.cli import main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    print("EXIT", stop.code, "torch" in sys.modules, "transformers" in sys.modules)
'''


@pytest.mark.parametrize("args, flag", [
    (["--prompt", "x", "--block-size", "100"], "--block-size"),
    (["--prompt", "x", "--block-size", "eight"], "--block-size"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "x", "--model", "/no/such/folder"], "--model"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
])
def test_bad_values_fail_fast_in_one_line(args, flag):
    run = subprocess.run([sys.executable, "-c", CHECK, "generate", *args], capture_output=True, text=True,
                         timeout=120)
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recguide generate: error: argument " + flag), run.stderr
    assert run.stdout.strip() == "EXIT 2 False False"  # nothing heavy was imported before the check
