"""Data-parallel replicas on Ray Serve: one engine per device, one OpenAI endpoint.

Each replica is a Ray Serve deployment replica running the same FastAPI app as
``rlt-hal serve`` (:func:`runtime_glue.server.app.build_app`) on one device that Ray hands it:
``NPU`` (Ray sets ``ASCEND_RT_VISIBLE_DEVICES``), ``GPU`` (``CUDA_VISIBLE_DEVICES``) or CPU
cores (``OMP_NUM_THREADS``). Serve's proxy spreads requests over the replicas, restarts a
replica that dies, and places replicas across the nodes of a cluster.

This module imports Ray; only ``rlt-hal serve --replicas N`` and Serve config files
(``import_path: runtime_glue.server.replicas:build_application``) load it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping

import attrs
import ray
from ray import serve

from hal.registry import DEVICE_ENV_VAR, parse_device
from runtime_glue.engine.args import EngineArgs
from runtime_glue.engine.llm import build_llm
from runtime_glue.server.app import Server, build_app
from runtime_glue.server.args import ServerArgs, as_options, split_options

logger = logging.getLogger(__name__)

APP_NAME = "rlt-hal"
REPLICA_HEADER = "x-rlt-hal-replica"
# The Ray resource a replica of each driver asks for; any other driver gets CPU cores only.
RAY_RESOURCE = {"npu": "NPU", "cuda": "GPU"}
METRICS_MIRROR_INTERVAL_S = 5.0


def device_kind(device: str | None, cluster: Mapping[str, float]) -> str:
    """The driver every replica runs: ``--device`` or ``$VLLM_RLT_DEVICE`` by name (no index:
    Ray gives each replica its own device), else the first of npu, cuda, cpu the cluster has."""
    text = device if device and device != "auto" else os.environ.get(DEVICE_ENV_VAR, "")
    if text.strip() in ("", "auto"):
        return next((k for k, r in RAY_RESOURCE.items() if cluster.get(r, 0) >= 1), "cpu")
    name, index = parse_device(text)
    if index is not None:
        raise ValueError(
            f"--device {text!r}: with --replicas, Ray gives each replica its own device; "
            f"give the kind only (--device {name})"
        )
    return name


def cpus_per_replica(given: float | None) -> float:
    cpus = 1.0 if given is None else float(given)
    if cpus <= 0:
        raise ValueError(f"cpus_per_replica must be > 0, got {given}")
    return cpus


def actor_options(device: str, cpus_per_replica: float) -> dict:
    """What one replica asks Ray for: one device of its kind and some CPU cores."""
    options: dict = {"num_cpus": cpus_per_replica}
    if device == "cuda":
        options["num_gpus"] = 1
    elif device in RAY_RESOURCE:
        options["resources"] = {RAY_RESOURCE[device]: 1}
    return options


def check_capacity(device: str, replicas: int, cpus: float, cluster: Mapping[str, float]) -> None:
    """Fail now, not by waiting forever for replicas Ray cannot place."""
    need = {"CPU": replicas * cpus}
    if device in RAY_RESOURCE:
        need[RAY_RESOURCE[device]] = replicas
    for resource, amount in need.items():
        have = cluster.get(resource, 0)
        if have < amount:
            hint = (
                "; Ray counts NPUs with AscendCL or /dev/davinci*: source CANN's set_env.sh "
                "before `ray start`"
                if resource == "NPU"
                else ""
            )
            raise RuntimeError(
                f"{replicas} replica(s) on {device} need {amount:g} {resource} but the Ray "
                f"cluster has {have:g} (`ray status` lists its resources){hint}"
            )


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that made it."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


class MetricsMirror:
    """Copies this replica's ``rlt_hal_*`` samples into Ray's metrics every few seconds, so
    that each node's Ray metrics port (``ray start --metrics-export-port``) serves every
    replica's engine metrics, tagged with ``replica``, ``deployment`` and ``application``.
    A replica's own ``GET /metrics`` stays as in ``rlt-hal serve``, but through the Serve
    proxy it reaches whichever replica the router picks (named by the response header)."""

    def __init__(self, registry, interval_s: float = METRICS_MIRROR_INTERVAL_S) -> None:
        self.registry, self.interval_s = registry, interval_s
        self._gauges: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlt-hal-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.copy()
            except Exception:  # noqa: BLE001 - metrics must never take a replica down
                logger.exception("mirroring metrics into Ray failed")

    def copy(self) -> None:
        from ray.serve.metrics import Gauge

        for family in self.registry.collect():
            for sample in family.samples:
                if not sample.name.startswith("rlt_hal_") or sample.name.endswith("_created"):
                    continue  # process and platform series are Ray's own; _created means nothing
                gauge = self._gauges.get(sample.name)
                if gauge is None:
                    gauge = self._gauges[sample.name] = Gauge(
                        sample.name, family.documentation, tag_keys=tuple(sorted(sample.labels))
                    )
                gauge.set(sample.value, tags=dict(sample.labels))

    def stop(self) -> None:
        self._stop.set()


@serve.ingress()
class Replica:
    """One rlt-hal engine and its OpenAI app; Serve builds the app after ``__init__``."""

    def __init__(self, engine: EngineArgs, options: ServerArgs) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        llm = build_llm(engine, announce=True)
        self.server = Server.from_args(llm, engine, options)
        self.mirror = MetricsMirror(self.server.loop.metrics.registry)
        print(f"replica {self.replica}: {llm.driver.label}", file=sys.stderr)

    def check_health(self) -> None:
        """Serve calls this every 10 s: a replica whose engine loop died is replaced."""
        self.server.loop.check()

    def __serve_build_asgi_app__(self):
        return ReplicaHeader(build_app(self.server), self.replica)

    def __del__(self) -> None:
        self.mirror.stop()


def build_application(args: Mapping):
    """The Serve application: ``replicas`` copies of the rlt-hal server.

    ``args`` holds ``rlt-hal serve`` options by field name (``model``, ``device``,
    ``max_num_seqs``, ``replicas``, ``cpus_per_replica``, ...: ``EngineArgs`` and
    ``ServerArgs``); this is the builder a Serve config file names (Serve passes it the file's
    ``args``).
    """
    engine, options = split_options(args)
    replicas = 1 if options.replicas is None else int(options.replicas)
    cpus = cpus_per_replica(options.cpus_per_replica)
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    cluster = ray.cluster_resources() if ray.is_initialized() else {}
    device = device_kind(engine.device, cluster)
    engine = attrs.evolve(engine, device=device)
    deployment = serve.deployment(Replica, name=APP_NAME).options(
        num_replicas=replicas,
        ray_actor_options=actor_options(device, cpus),
        # As many requests as one engine batches: more would only wait inside it, where the
        # router can no longer send them to an idle replica.
        max_ongoing_requests=engine.max_num_seqs,
    )
    return deployment.bind(engine, options)


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(engine: EngineArgs, args: ServerArgs) -> int:
    """``rlt-hal serve --replicas N``: start (or join) a Ray cluster, deploy, wait for a signal."""
    if args.replicas is None or args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    joined = args.ray_address is not None
    if joined and args.ray_metrics_export_port is not None:
        raise ValueError(
            "--ray-metrics-export-port applies to a cluster this command starts; "
            "a joined cluster's nodes take theirs from `ray start --metrics-export-port`"
        )
    if not joined:  # the cluster's HTTP proxy will listen here: a port in use is said at once
        from runtime_glue.server.app import listening_socket

        listening_socket(args.host, args.port).close()
    ray.init(
        address=args.ray_address,
        logging_level=logging.WARNING,
        _metrics_export_port=args.ray_metrics_export_port,
    )
    # After ray.init, whose own SIGTERM handler would abort the process: SIGINT and SIGTERM
    # interrupt whatever runs, deploying included, and the cleanup below runs either way.
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    for sig in stop_signals:
        signal.signal(sig, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        cluster = ray.cluster_resources()
        device = device_kind(engine.device, cluster)
        check_capacity(device, args.replicas, cpus_per_replica(args.cpus_per_replica), cluster)
        options = as_options(attrs.evolve(engine, device=device), args)
        serve.run(build_application(options), name=APP_NAME)
        print(
            f"serving {args.model_name(engine)!r} on http://{args.host}:{args.port}/v1 with "
            f"{args.replicas} replica(s) on {device} (Ray Serve; "
            f"{f'joined {args.ray_address}' if joined else 'a local Ray cluster'})",
            file=sys.stderr,
        )
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("shutting down the replicas", file=sys.stderr)
    finally:
        for sig in stop_signals:  # the cleanup itself is not interrupted
            signal.signal(sig, signal.SIG_IGN)
        # A cluster we started goes with us; on a joined one only our application does.
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0
