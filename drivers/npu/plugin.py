"""Entry point ``rlt_hal: npu``. The probe looks for torch_npu without importing it."""

import importlib.util

from hal import DriverSpec, ProbeResult, hookimpl


def _probe() -> ProbeResult:
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(
            False,
            "torch_npu is not installed; install the torch_npu release that matches your torch "
            "and CANN (see docs/ascend.md)",
        )
    return ProbeResult(False, "the npu driver is not built yet in this version of rlt-hal")


def _create(**options):
    raise RuntimeError("the npu driver is not built yet in this version of rlt-hal")


@hookimpl
def rlt_hal_register_drivers() -> list[DriverSpec]:
    return [DriverSpec("npu", _probe, _create, "Ascend NPU (torch_npu + CANN)")]
