"""The command line checks its arguments before it loads anything: one line naming the flag, exit status 2."""

import subprocess
import sys

import pytest

CHECK = r'''
import sys
from recguide_hf.tools.cli import main
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


def test_profile_writes_into_a_folder_it_makes(tmp_path):
    """`recguide profile --out` into a folder that does not exist yet: the folder is made before the minutes of
    measuring (it used to fail at the very end, losing them); a folder without a tokenizer profiles too."""
    import json

    from conftest import tiny_model

    from recguide_hf.models.export import save_model_folder
    from recguide_hf.tools.cli import main

    save_model_folder(tiny_model(0), None, tmp_path / "model")
    out = tmp_path / "new" / "deeper" / "cost_table.json"
    main(["profile", "--model", str(tmp_path / "model"), "--concurrency", "1", "2", "--block-sizes", "1", "2",
          "--prefix-len", "4", "--repeats", "1", "--out", str(out)])
    costs = json.loads(out.read_text())["costs"]
    assert sorted(costs) == ["1", "2"] and sorted(costs["2"]) == ["1", "2"]
    assert costs["2"]["2"]["draft"] > 0 and costs["2"]["1"]["draft"] == 0  # B = 1 is a plain step: no draft


def test_busy_hint_only_where_torch_threads_would_share_the_cores():
    from recguide_hf.tools.cli import busy_hint

    assert busy_hint(load=0.1, cores=2, threads=2) is None  # an idle machine
    assert busy_hint(load=3.0, cores=2, threads=1) is None  # one thread already
    hint = busy_hint(load=1.0, cores=2, threads=2)  # one busy process beside torch's two threads
    assert hint is not None and "OMP_NUM_THREADS=1" in hint and "load 1.0 on 2 cores" in hint
    assert busy_hint(load=0.4, cores=16, threads=16) is None
