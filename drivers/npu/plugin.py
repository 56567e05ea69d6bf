"""Entry point ``rlt_hal: npu``. The probe looks for torch_npu, CANN, the NPU driver and the
devices without importing any of them (``drivers.npu.environment``)."""

import importlib.util

from drivers.npu import environment
from drivers.npu.emulation import emulation_requested
from hal import DriverSpec, ProbeResult, hookimpl


def _probe() -> ProbeResult:
    if emulation_requested():
        return ProbeResult(
            True,
            "emulated: RLT_HAL_NPU_EMULATE=1 runs torch_npu's operations "
            "on the CPU (a test double, not hardware)",
            emulated=True,
        )
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(
            False,
            "torch_npu is not installed; install the torch_npu release that matches your torch "
            "and CANN (see docs/ascend.md), or set RLT_HAL_NPU_EMULATE=1 for the CPU emulation",
        )
    why = environment.problem()
    return ProbeResult(why is None, why or "")


def _create(**options):
    from drivers.npu.driver import create

    return create(**options)


@hookimpl
def rlt_hal_register_drivers() -> list[DriverSpec]:
    return [DriverSpec("npu", _probe, _create, "Ascend NPU (torch_npu + CANN): ascend_eager")]
