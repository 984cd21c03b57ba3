"""Start `recguide serve` on a free localhost port and wait until it answers (tests and eval/serve_load.py)."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

REPLICA_LINE = re.compile(r"\d\d:\d\d:\d\d replicas: ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(subprocess.Popen):
    """The server's process; a thread keeps reading its output (so a chatty server, Ray's, never blocks on a full
    pipe) and keeps the last lines (`tail()`)."""

    def __init__(self, cmd: list[str], env: dict | None):
        super().__init__(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # its own process group: `stop_server` can end all of it
        self.lines: collections.deque[str] = collections.deque(maxlen=2000)
        self.replica_lines: list[str] = []  # a Ray server's `HH:MM:SS replicas: ...` lines, all of them
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.stdout:
            self.lines.append(line)
            found = REPLICA_LINE.search(line)  # also after another thread's text that had no newline yet
            if found:
                self.replica_lines.append(line[found.start():].strip())

    def tail(self, chars: int = 3000) -> str:
        return "".join(self.lines)[-chars:]

    def printed(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))


def start_server(args: list[str], timeout: float = 180, env: dict | None = None,
                 ready_text: str | None = None) -> tuple[Server, str]:
    """`recguide serve ARGS --port <free port>` (127.0.0.1, the server's default host) in a child process; returns
    it and its base URL once `/health` answers 200 (and, with `ready_text`, once the server printed it: Ray's proxy
    answers before every replica is up). Raises RuntimeError, with the end of the server's output, if it exits or
    is not ready within `timeout` seconds."""
    port = free_port()
    return wait_ready(Server([sys.executable, "-m", "recguide_hf", "serve", *args, "--port", str(port)], env),
                      f"http://127.0.0.1:{port}", timeout, ready_text)


def wait_ready(proc: Server, base: str, timeout: float = 180, ready_text: str | None = None) -> tuple[Server, str]:
    """`proc` (any OpenAI-compatible server started as a `Server` on `base`, e.g. `vllm serve` in
    eval/vllm_peer.py) and `base` once its `/health` answers 200 (and it printed `ready_text`, if given);
    RuntimeError with the end of its output if it exits or is not ready within `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc._reader.join(5)
            raise RuntimeError("server exited: " + proc.tail())
        try:
            if (ready_text is None or proc.printed(ready_text)) and \
                    httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not ready in {timeout:.0f} s: " + proc.tail())


def stop_server(proc: subprocess.Popen, timeout: float = 20):
    """SIGTERM (the server shuts down: a Ray one stops its replicas and its Ray instance, which takes a while),
    SIGKILL past `timeout` seconds, then SIGKILL to whatever is left of its process group."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if isinstance(proc, Server):  # whatever of its group is left (a Ray instance's processes)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def burst(client, model: str, count: int, timeout: float = 300, prompt: str = "class A:",
          max_tokens: int = 200, refusals: list | None = None) -> list:
    """`count` long greedy completions at once (an `openai` client): each one's HTTP status (200, or the refusal's
    code), or the repr of any other error; bounded by `timeout` seconds per thread. `refusals`, when given, gets
    each refusal's (status, content type, body text)."""
    import openai

    codes: list = []

    def one():
        try:
            client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
            codes.append(200)
        except openai.APIStatusError as err:
            codes.append(err.status_code)
            if refusals is not None:
                refusals.append((err.status_code, err.response.headers.get("content-type", ""), err.response.text))
        except Exception as err:  # noqa: BLE001 - shown to the caller
            codes.append(repr(err)[:80])

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return codes
