"""Start `recguide serve` on a free localhost port and wait until it answers (tests and eval/serve_load.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], timeout: float = 180, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`recguide serve ARGS --port <free port>` (127.0.0.1, the server's default host) in a child process; returns
    it and its base URL once `/health` answers 200. Raises RuntimeError, with the end of the server's output, if it
    exits or does not answer within `timeout` seconds."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "recguide_hf", "serve", *args, "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + proc.stdout.read()[-3000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not come up in {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 20):
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
