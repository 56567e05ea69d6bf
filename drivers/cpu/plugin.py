"""Entry point ``rlt_hal: cpu``."""

from hal import DriverSpec, ProbeResult, hookimpl


def _probe() -> ProbeResult:
    return ProbeResult(True)


def _create(**options):
    from drivers.cpu.driver import create

    return create(**options)


@hookimpl
def rlt_hal_register_drivers() -> list[DriverSpec]:
    return [DriverSpec("cpu", _probe, _create, "host CPU, reference eager attention")]
