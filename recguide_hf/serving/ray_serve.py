"""RecGuide replicas on Ray Serve (`recguide serve --replicas N`; the `ray` extra).

One Serve deployment, `RecGuide`: each replica loads the model, runs its own `EngineWorker` (continuous
batching on its own decoding thread) and serves the same FastAPI app as `recguide serve` (`app.build_app`)
through Serve's FastAPI ingress, built on the replica once the model is loaded (`__serve_build_asgi_app__`):
one HTTP layer, the OpenAI schemas, limits and error shapes of the single server. Serve's proxy routes each
request to a replica, queues what no replica has room for and streams responses back.

- `max_ongoing_requests` = the replica's rows (`slots`): a replica never holds more requests than it decodes at
  once, so the queue lives in Serve's router, bounded by `max_queued_requests`; past it the proxy answers 503.
- Autoscaling (`min_replicas`..`max_replicas`) on ongoing requests per replica (`target_ongoing_requests`).
- Each response carries `x-recguide-replica` (the replica's id); `/metrics` adds `recguide_replica_info` (id and
  process id); each replica's free rows and block mix are its routing stats (`record_routing_stats`, for a
  custom request router: Serve's default one does not read them).
- A replica whose decoding thread stopped fails Serve's health check and is replaced.

`deployment_args(...)` is the one place the settings become Serve's options; `build(args)` is an application
builder, so Serve's own config files run the same deployment (`serve run` / `serve deploy`, see `config_yaml`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ray import serve

REPLICA_HEADER = "x-recguide-replica"



@dataclass
class ReplicaSettings:
    """What each replica loads and how it serves (JSON-able: it travels in Serve's config)."""

    model: str | None = None  # a model folder (default: the bundled recguide-tiny)
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    threads: int = 1  # torch threads per replica (OMP_NUM_THREADS)
    slots: int = 16
    max_waiting: int = 16  # the worker's own queue, a margin only (a cancelled row frees at its next round):
    # Serve sends a replica at most `slots` requests and queues the rest in its router (max_queued_requests)
    max_prompt_tokens: int = 1024
    max_tokens: int = 512
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_open_streams: int = 64


@dataclass
class ScaleSettings:
    """How many replicas, and how Serve queues and scales them."""

    replicas: int = 1  # fixed count (ignored when autoscale is set)
    autoscale: tuple[int, int] | None = None  # (min_replicas, max_replicas)
    target_ongoing: float | None = None  # ongoing requests per replica the autoscaler aims for (default: slots/2)
    max_queued: int = 64  # requests Serve queues for all replicas beyond their rows; more get 503
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict)


class RecGuideReplica:
    """One replica: a model, its decoding thread, and the server's FastAPI app over them."""

    def __init__(self, settings: dict):
        import torch

        from ..models.loading import load
        from .worker import EngineWorker, WorkerLimits

        self.settings = ReplicaSettings(**settings)
        s = self.settings
        torch.set_num_threads(s.threads)
        self.tokenizer, model = load(s.model, s.dtype, s.device)
        self.worker = EngineWorker(model, WorkerLimits(slots=s.slots, max_waiting=s.max_waiting,
                                                       max_prompt_tokens=s.max_prompt_tokens,
                                                       max_new_tokens=s.max_tokens)).start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        from .. import BUNDLED_MODEL
        from .app import ServerLimits, build_app

        s = self.settings
        name = s.served_model_name or os.path.basename(os.path.normpath(s.model or str(BUNDLED_MODEL)))
        return build_app(self.worker, self.tokenizer, name,
                         ServerLimits(api_key=s.api_key, max_body_bytes=s.max_body_bytes,
                                      max_open_streams=s.max_open_streams),
                         replica=(self.replica_id, os.getpid()))

    def check_health(self):
        """Serve's health check: a replica whose decoding thread stopped is restarted."""
        if not self.worker.alive:
            raise RuntimeError(f"the decoding thread has stopped: {self.worker.error!r}")

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's controller collects from each replica (every `request_routing_stats_period_s`) for a
        custom request router; Serve's default router (power of two choices) does not read it."""
        running, waiting = self.worker.counts()
        blocks = dict(self.worker.metrics.blocks)  # a copy: the decoding thread updates it
        return {"free_rows": self.settings.slots - running, "waiting": waiting,
                "block_rounds": {str(b): n for b, n in blocks.items()}}

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop()


RecGuide = serve.deployment(name="RecGuide")(serve.ingress()(RecGuideReplica))


def deployment_options(settings: ReplicaSettings, scale: ScaleSettings) -> dict[str, Any]:
    """Serve's deployment options for these settings (also what `config_yaml` writes)."""
    opts: dict[str, Any] = {
        "max_ongoing_requests": settings.slots, "max_queued_requests": scale.max_queued,
        "ray_actor_options": {"num_cpus": settings.threads,
                              "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(settings.threads)}}},
        "health_check_period_s": 2, "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": 10,
    }
    if scale.autoscale:
        lo, hi = scale.autoscale
        opts["autoscaling_config"] = {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
            "target_ongoing_requests": scale.target_ongoing or max(1.0, settings.slots / 2),
            "upscale_delay_s": scale.upscale_delay_s, "downscale_delay_s": scale.downscale_delay_s,
            "look_back_period_s": 5.0}
    else:
        opts["num_replicas"] = scale.replicas
    return {**opts, **scale.extra}


def application(settings: ReplicaSettings, scale: ScaleSettings):
    """The Serve application: `serve.run(application(...))`."""
    return RecGuide.options(**deployment_options(settings, scale)).bind(asdict(settings))


def build(args: dict[str, Any]):
    """Serve's application builder: `import_path: recguide_hf.serving.ray_serve:build` with `args` = the
    replica's settings (`ReplicaSettings` fields); the deployment's options come from the config's
    `deployments:` entry (Serve applies them over the defaults here)."""
    settings = ReplicaSettings(**args)
    return RecGuide.options(**deployment_options(settings, ScaleSettings())).bind(asdict(settings))


def config_yaml(settings: ReplicaSettings, scale: ScaleSettings, host: str, port: int) -> str:
    """Serve's config file for these settings: `serve run FILE` / `serve deploy FILE` run the same deployment."""
    import json

    opts = deployment_options(settings, scale)
    args = {k: v for k, v in asdict(settings).items() if v != getattr(ReplicaSettings, k, None) or k == "model"}

    def dump(value: Any, indent: int) -> list[str]:  # YAML's block style; scalars as JSON (valid YAML)
        pad = " " * indent
        lines = []
        for k, v in value.items():
            if isinstance(v, dict) and v:
                lines += [f"{pad}{k}:", *dump(v, indent + 2)]
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}")
        return lines

    out = ["# recguide serve --replicas ...: Ray Serve's config (serve run FILE, or serve deploy FILE on a cluster)",
           "proxy_location: EveryNode", "http_options:", f"  host: {json.dumps(host)}", f"  port: {port}",
           "applications:", "  - name: recguide", "    route_prefix: /",
           "    import_path: recguide_hf.serving.ray_serve:build", "    args:", *dump(args, 6),
           "    deployments:", "      - name: RecGuide", *dump(opts, 8)]
    return "\n".join(out) + "\n"


def replica_states() -> dict[str, int]:
    """{state: count} of the deployment's replicas (RUNNING, STARTING, STOPPING...), from Serve's status."""
    try:
        app = serve.status().applications["recguide"]
        return {str(getattr(k, "value", k)): n for k, n in app.deployments["RecGuide"].replica_states.items() if n}
    except (KeyError, AttributeError):
        return {}


def routed_to_every_replica(host: str, port: int, count: int, api_key: str | None = None,
                            timeout: float = 300.0) -> set[str]:
    """Wait until `count` replicas run AND Serve's proxy routes to each of them: `serve.run` returns when the
    application is up, but the proxy learns of replicas started late (the second of two, on a busy machine) a
    moment later, and a burst sent meanwhile all lands on the first. Probes `/v1/models` through the proxy (each
    answer names its replica, `x-recguide-replica`) until `count` different replicas answered. Returns their ids;
    raises TimeoutError after `timeout` seconds."""
    import time
    import urllib.error
    import urllib.request

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}/v1/models"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica_states().get("RUNNING", 0) >= count:
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
                    if r.headers.get(REPLICA_HEADER):
                        seen.add(r.headers[REPLICA_HEADER])
            except (urllib.error.URLError, OSError):  # the proxy's own error while it catches up
                pass
            if len(seen) >= count:
                return seen
            time.sleep(0.05)
        else:
            time.sleep(0.5)
    raise TimeoutError(f"Serve's proxy routed to {len(seen)} of {count} replicas within {timeout:.0f} s")


def run(settings: ReplicaSettings, scale: ScaleSettings, host: str = "127.0.0.1", port: int = 8000,
        address: str | None = None, num_cpus: int | None = None, on_ready=None) -> None:
    """Start Ray (a local instance unless `address` names a cluster), Serve's proxy on host:port, and the
    deployment; call `on_ready` once the proxy routes to every replica (`routed_to_every_replica`: the count, or
    autoscaling's minimum); block until interrupted (SIGINT / SIGTERM), then shut Serve and Ray down.

    A local instance advertises 127.0.0.1 only when Ray was imported with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    (Ray reads it at import; despite its name it is how Linux gets a loopback-only node too): `recguide serve`
    sets it; Ray's gRPC servers still listen on every interface, as Ray's always do, behind its token
    authentication (on by default): firewall a shared machine."""
    import signal
    import sys
    import threading
    import time

    import ray

    if address:
        ray.init(address=address)
    else:  # always a new instance of our own, never one a RAY_ADDRESS or an earlier `ray start` points at
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(settings, scale), name="recguide", route_prefix="/")
        wanted = scale.autoscale[0] if scale.autoscale else scale.replicas
        routed_to_every_replica(host, port, wanted, settings.api_key)
        if on_ready:
            on_ready()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        last = None
        while not stop.wait(1.0):  # say when the replicas change (autoscaling, a replica replaced)
            states = replica_states()
            if states != last:
                # one write of the whole line: print's separate newline write lets Ray's log thread (the replicas'
                # access lines, on this same stdout) land inside it, and the line then no longer starts a line
                sys.stdout.write(time.strftime("%H:%M:%S") + " replicas: " + ", ".join(
                    f"{n} {k.lower()}" for k, n in sorted(states.items())) + "\n")
                sys.stdout.flush()
                last = states
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C during the shutdown ends it
            signal.signal(sig, signal.SIG_DFL)
        try:
            if address:
                serve.delete("recguide")  # a shared cluster keeps its other applications and Serve itself
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
