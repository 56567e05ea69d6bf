"""The deterministic plan's kernel choices, made once per machine, model shape and flags.

Where several kernels keep deterministic mode for an op, which one runs is chosen by timing
them (``runtime_glue.ouro.kernel_trials``), and timings move with the machine's load. A request's
bits depend on that choice, so the choice itself, not the timings behind it, is what must
last: the first engine to need it measures and records it, and every later engine of this
machine, model shape and plan flags reuses it (after the start-up check, which is never
recorded). Measuring again is an explicit act (``--remeasure-plan``) that says so.

A record lives in ``$RLT_HAL_CACHE/plans/<driver>-<hash>.json``, written atomically under a
file lock, so that engines starting together (replicas, parallel tests) measure once between
them; this process also keeps every choice it made or read, so that its engines agree even if
the file goes away between them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

from hal.cache import cache_dir
from hal.interfaces import Driver
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.plan import GENERATED_TILE, KINDS, PROMPT_TILE, Measurement, OpChoice

logger = logging.getLogger(__name__)

FORMAT = 2  # 1 was a cache of timings, from which every engine chose again

# What this process has read or written, by record path: a choice outlives its file here.
_REMEMBERED: dict[Path, dict] = {}


def machine_fingerprint() -> dict:
    """What decides which code paths a library takes here: CPU model and flags, torch, the
    thread count and the variables that cap an instruction set."""
    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("model name", "flags") and name.strip() not in cpu:
                cpu[name.strip()] = value.strip()
    except OSError:
        cpu["processor"] = platform.processor()
    env = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_CBWR")
    return {
        **cpu,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        **{v: os.environ.get(v) for v in env},
    }


def load_average() -> str:
    """The machine's 1-minute load average and core count, for notes beside a measurement."""
    try:
        return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    except OSError:
        return "load unknown"


@attrs.frozen
class Recorded:
    """A recorded choice: for each row kind, each op's kernel and tiles; what was measured."""

    chosen: dict[str, dict[str, OpChoice]]
    measurements: tuple[Measurement, ...]
    notes: tuple[str, ...]
    when: str  # when and under what load it was measured


class PlanRecord:
    """The record of one (machine, driver and its kernels, model shape, plan flags)."""

    def __init__(
        self,
        driver: Driver,
        cfg: OuroConfig,
        attention: str,
        linear: str | None,
        weights: str = "bf16",
    ):
        key = {
            "format": FORMAT,
            "machine": machine_fingerprint(),
            "driver": driver.label,
            "kernels": [(k.op, k.name, k.version) for k in driver.kernels],
            "config": attrs.asdict(cfg),
            "tiles": [PROMPT_TILE, GENERATED_TILE],
            "attention": attention,
            "linear": linear,
            "weights": weights,  # resolve.weights_label: the scheme and group size
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
        self.path = cache_dir() / "plans" / f"{driver.name}-{digest.hexdigest()[:16]}.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the record's lock: one engine of this machine measures, the others wait and
        then read its choice. Without a writable cache, no lock (and no record)."""
        try:
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_suffix(".lock"), "a")  # noqa: SIM115
        except (ImportError, OSError) as exc:
            logger.warning("plan choices cannot be recorded in %s: %s", self.path.parent, exc)
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def load(self) -> Recorded | None:
        raw = _REMEMBERED.get(self.path)
        if raw is None:
            try:
                raw = json.loads(self.path.read_text())
            except FileNotFoundError:
                return None
            except (OSError, json.JSONDecodeError) as exc:
                logger.warning("ignoring the unreadable plan record %s: %s", self.path, exc)
                return None
        try:
            recorded = _parse(raw)
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("ignoring the malformed plan record %s: %s", self.path, exc)
            return None
        _REMEMBERED[self.path] = raw
        return recorded

    def save(self, recorded: Recorded) -> None:
        raw = {
            "format": FORMAT,
            "when": recorded.when,
            "chosen": {
                kind: {op: attrs.asdict(c) for op, c in ops.items()}
                for kind, ops in recorded.chosen.items()
            },
            "measurements": [attrs.asdict(m) for m in recorded.measurements],
            "notes": list(recorded.notes),
        }
        _REMEMBERED[self.path] = raw
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("the plan choice could not be recorded in %s: %s", self.path, exc)


def now(extra: str = "") -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"{stamp}, {load_average()}{extra}"


def _parse(raw: dict) -> Recorded:
    if raw.get("format") != FORMAT:
        raise ValueError(f"format {raw.get('format')!r}, not {FORMAT}")
    chosen = {
        kind: {
            op: OpChoice(c["kernel"], tuple(int(t) for t in c["tiles"]))
            for op, c in raw["chosen"][kind].items()
        }
        for kind in KINDS
    }
    measurements = tuple(Measurement(**m) for m in raw["measurements"])
    return Recorded(chosen, measurements, tuple(raw["notes"]), str(raw["when"]))
