"""What a driver plug-in hands to the registry: its name, a cheap probe and a factory."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from hal.interfaces import Driver


@attrs.frozen
class ProbeResult:
    """Whether a driver can run here; ``reason`` says why not (and what to install or set)."""

    available: bool
    reason: str = ""
    # An emulated driver (a test double for absent hardware) is never chosen by ``auto``.
    emulated: bool = False


@attrs.frozen
class DriverSpec:
    """What a plugin hands to the registry.

    ``probe`` must be cheap and must never import a vendor stack; ``create`` builds the driver
    (still without touching the device: the device initialises lazily).
    """

    name: str
    probe: Callable[[], ProbeResult]
    create: Callable[..., Driver]
    description: str = ""
