"""What an Ascend host needs before torch_npu can run, checked without importing anything.

The probe must be cheap and must not import the vendor stack, so it looks where the stack's
parts are: CANN's ``set_env.sh`` exports ``ASCEND_TOOLKIT_HOME`` and puts ``libascendcl.so`` on
``LD_LIBRARY_PATH``; the NPU driver provides ``libascend_hal.so``; each visible card is a
``/dev/davinciN`` node. Each missing part is named with what to install or set.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

CANN_HINT = "source /usr/local/Ascend/ascend-toolkit/set_env.sh (or your CANN install's set_env.sh)"
DRIVER_HINT = (
    "install the Ascend NPU driver and firmware packages for your card (npu-smi info shows "
    "whether they are loaded) and put /usr/local/Ascend/driver/lib64 on LD_LIBRARY_PATH"
)
TOOLKIT_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
DRIVER_DIRS = (
    "/usr/local/Ascend/driver/lib64",
    "/usr/local/Ascend/driver/lib64/driver",
    "/usr/local/Ascend/driver/lib64/common",
)


def _on_library_path(name: str, environ: Mapping[str, str], extra: tuple[str, ...] = ()) -> bool:
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d] + list(extra)
    return any((Path(d) / name).exists() for d in dirs)


def visible_devices(environ: Mapping[str, str], dev: Path) -> list[int]:
    """The card numbers this process may use: ``/dev/davinciN`` nodes, narrowed by
    ``ASCEND_RT_VISIBLE_DEVICES`` when it is set."""
    nodes = sorted(
        int(m.group(1))
        for p in dev.glob("davinci*")
        if (m := re.fullmatch(r"davinci(\d+)", p.name))
    )
    chosen = environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if chosen is None:
        return nodes
    wanted = [int(x) for x in chosen.split(",") if x.strip().isdigit()]
    return [n for n in wanted if n in nodes]


def problem(environ: Mapping[str, str] | None = None, dev: str | Path = "/dev") -> str | None:
    """None if the host looks ready for torch_npu, else what is missing and what to do."""
    environ = os.environ if environ is None else environ
    toolkit = next((environ[v] for v in TOOLKIT_VARS if environ.get(v)), None)
    if toolkit is None or not Path(toolkit).is_dir():
        return f"CANN is not set up (ASCEND_TOOLKIT_HOME is not set); {CANN_HINT}"
    if not _on_library_path("libascendcl.so", environ):
        return f"CANN's libascendcl.so is not on LD_LIBRARY_PATH; {CANN_HINT}"
    if not _on_library_path("libascend_hal.so", environ, DRIVER_DIRS):
        return f"the Ascend NPU driver is not installed (no libascend_hal.so); {DRIVER_HINT}"
    if not visible_devices(environ, Path(dev)):
        shown = environ.get("ASCEND_RT_VISIBLE_DEVICES")
        return (
            f"no Ascend device is visible (no {dev}/davinci<N> node, ASCEND_RT_VISIBLE_DEVICES="
            f"{shown!r}); check npu-smi info, and pass the devices into the container if any"
        )
    return None
