"""Nothing in the package, the bench or the CLI touches the network: run with the offline variables unset and
an audit hook that records (and blocks) every socket connection or name lookup that leaves this machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recguide_hf.tools.cli import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, socket, sys
attempts = []

def local(host):
    return str(host) in ("localhost", "127.0.0.1", "::1", "") or str(host).startswith("127.")

def hook(event, args):
    if event == "socket.connect":
        address = args[1]
        host = address[0] if isinstance(address, tuple) else address
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    if not local(host):
        attempts.append(f"{event} {host}")
        raise ConnectionRefusedError(f"test_offline: no network ({event} {host})")

sys.addaudithook(hook)
try:  # the hook itself works: a connection to a documentation address is caught before it leaves
    socket.create_connection(("192.0.2.1", 9), timeout=0.1)
except OSError:
    pass
assert attempts and attempts[0].endswith(" 192.0.2.1"), attempts
attempts.clear()

from recguide_hf.tools.prompts import load_prompts
for name in ("humaneval", "prose", "code"):
    assert load_prompts(name, 2)
from recguide_hf.tools.cli import main
assert main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
assert main(["bench", "--methods", "ar", "linear-4", "recguide", "--concurrency", "1", "--max-new-tokens", "8",
             "--repeats", "1", "--min-prompts", "2", "--prompts-per-slot", "1", "--out", sys.argv[1]]) == 0
print("ATTEMPTS " + json.dumps(attempts))
'''


@pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(), reason="bundled weights missing")
def test_no_network_with_offline_variables_unset(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "bench")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("ATTEMPTS ")][-1]
    assert json.loads(line[len("ATTEMPTS "):]) == []
    assert (tmp_path / "bench" / "bench.json").exists()
