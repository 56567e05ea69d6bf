"""Driver discovery (pluggy entry points, group ``rlt_hal``) and device selection.

Selection order: an explicit name (``--device``), else ``VLLM_RLT_DEVICE``, else ``auto``
(the first available of npu, cuda, cpu). An explicit choice fails loudly; only ``auto`` falls
back, and it records which candidates it skipped and why.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterable, Mapping
from typing import cast

import attrs
import pluggy

from hal import hookspecs
from hal.interfaces import Driver
from hal.spec import DriverSpec, ProbeResult

logger = logging.getLogger(__name__)

DEVICE_ENV_VAR = "VLLM_RLT_DEVICE"
AUTO_ORDER = ("npu", "cuda", "cpu")


@attrs.frozen
class Selection:
    """The outcome of :meth:`Registry.select`."""

    spec: DriverSpec
    index: int | None
    source: str  # "argument", "VLLM_RLT_DEVICE" or "auto"
    skipped: tuple[tuple[str, str], ...] = ()  # (name, reason) of auto candidates passed over


def parse_device(text: str) -> tuple[str, int | None]:
    """``"npu:1"`` -> ``("npu", 1)``; ``"cpu"`` -> ``("cpu", None)``."""
    name, sep, index = text.strip().partition(":")
    if not name:
        raise ValueError(f"device must be a driver name such as 'cpu' or 'npu:1', got {text!r}")
    if not sep:
        return name.lower(), None
    if not index.isdigit():
        raise ValueError(f"device index must be a non-negative integer, got {text!r}")
    return name.lower(), int(index)


def safe_probe(spec: DriverSpec) -> ProbeResult:
    """A probe that raises is a driver that is unavailable, not a crash of the registry."""
    try:
        return spec.probe()
    except Exception as exc:  # noqa: BLE001 - third-party probes may fail in any way
        return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")


def broken_plugin(name: str, error: str) -> DriverSpec:
    """A plug-in that failed to load or to register: listed, never available, saying why."""
    reason = f"its plug-in failed: {error}"

    def create(**_options):
        raise RuntimeError(f"driver {name!r} cannot be created: {reason}")

    return DriverSpec(name, lambda: ProbeResult(False, reason), create, "broken plug-in")


class Registry:
    """All drivers that plugins registered, by name.

    Each plug-in loads and registers on its own: one that raises (a missing dependency, a
    bug) becomes an unavailable driver named after its entry point, whose reason is the
    error, and every other driver still works.
    """

    def __init__(self, plugins: Iterable[object] = (), load_entrypoints: bool = True) -> None:
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        self._specs: dict[str, DriverSpec] = {}
        if load_entrypoints:
            self._load_entrypoints()
        for plugin in plugins:
            self.plugin_manager.register(plugin)
        for impl in self.plugin_manager.hook.rlt_hal_register_drivers.get_hookimpls():
            name = self.plugin_manager.get_name(impl.plugin) or repr(impl.plugin)
            try:
                specs = list(cast(Iterable[DriverSpec], impl.function()))
                if not all(isinstance(s, DriverSpec) for s in specs):
                    raise TypeError("rlt_hal_register_drivers must return DriverSpec values")
            except Exception as exc:  # noqa: BLE001 - a third-party plug-in may fail in any way
                self._add(broken_plugin(name, f"{type(exc).__name__}: {exc}"))
                continue
            for spec in specs:
                self._add(spec)

    def _load_entrypoints(self) -> None:
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
            if self.plugin_manager.get_plugin(ep.name) is not None:
                continue  # one distribution installed twice on the path
            try:
                self.plugin_manager.register(ep.load(), name=ep.name)
            except Exception as exc:  # noqa: BLE001 - importing a plug-in may fail in any way
                logger.warning("rlt_hal plug-in %s (%s) failed to load: %s", ep.name, ep.value, exc)
                self._add(
                    broken_plugin(ep.name, f"loading {ep.value}: {type(exc).__name__}: {exc}")
                )

    def _add(self, spec: DriverSpec) -> None:
        if spec.name in self._specs:
            raise RuntimeError(f"two plugins register a driver named {spec.name!r}")
        self._specs[spec.name] = spec

    @property
    def names(self) -> list[str]:
        return sorted(self._specs)

    def spec(self, name: str) -> DriverSpec:
        if name not in self._specs:
            known = ", ".join(self.names) or "none (is rlt-hal installed?)"
            raise ValueError(f"unknown device {name!r}; known drivers: {known}")
        return self._specs[name]

    def probe_all(self) -> list[tuple[DriverSpec, ProbeResult]]:
        return [(self._specs[n], safe_probe(self._specs[n])) for n in self.names]

    def select(self, device: str | None = None, env: Mapping[str, str] | None = None) -> Selection:
        env = os.environ if env is None else env
        if device and device != "auto":
            source, text = "argument", device
        elif env.get(DEVICE_ENV_VAR, "").strip() not in ("", "auto") and not device:
            source, text = DEVICE_ENV_VAR, env[DEVICE_ENV_VAR]
        else:
            return self._select_auto()
        name, index = parse_device(text)
        spec = self.spec(name)
        probe = safe_probe(spec)
        if not probe.available:
            via = "--device" if source == "argument" else source
            raise RuntimeError(
                f"device {name!r} (chosen by {via}) is not available: {probe.reason}"
            )
        return Selection(spec, index, source)

    def _select_auto(self) -> Selection:
        skipped: list[tuple[str, str]] = []
        for name in AUTO_ORDER:
            if name not in self._specs:
                continue
            probe = safe_probe(self._specs[name])
            if probe.available and probe.emulated:
                skipped.append((name, "emulated drivers are used only when chosen explicitly"))
                continue
            if probe.available:
                for other, why in skipped:
                    logger.info("auto device selection skipped %s: %s", other, why)
                return Selection(self._specs[name], None, "auto", tuple(skipped))
            skipped.append((name, probe.reason))
        reasons = "; ".join(f"{n}: {why}" for n, why in skipped)
        raise RuntimeError(f"no device is available for auto selection ({reasons})")

    def create(self, device: str | None = None, **options) -> Driver:
        """Select a driver and build it. A driver chosen by name initialises lazily (its errors
        then say what to install); ``auto`` initialises each candidate it would pick and passes
        over one that fails, so it never returns a driver that cannot start."""
        selection = self.select(device)
        if selection.source != "auto":
            if selection.index is not None:
                options.setdefault("index", selection.index)
            return selection.spec.create(**options)
        skipped = list(selection.skipped)
        for spec in self._auto_candidates(selection.spec.name):
            try:
                driver = spec.create(**options)
                driver.device.initialize()
            except Exception as exc:  # noqa: BLE001 - any failure means "not this one"
                skipped.append((spec.name, f"it failed to initialise: {exc}"))
                logger.info("auto device selection skipped %s: %s", spec.name, exc)
                continue
            return driver
        reasons = "; ".join(f"{n}: {why}" for n, why in skipped)
        raise RuntimeError(f"no device is available for auto selection ({reasons})")

    def _auto_candidates(self, first: str):
        """Available, non-emulated drivers in ``AUTO_ORDER`` from ``first`` on."""
        for name in AUTO_ORDER[AUTO_ORDER.index(first) :]:
            if name in self._specs:
                probe = safe_probe(self._specs[name])
                if probe.available and not probe.emulated:
                    yield self._specs[name]


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry built from installed entry points (built lazily, once)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default
