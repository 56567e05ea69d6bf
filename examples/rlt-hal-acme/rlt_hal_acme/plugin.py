"""Entry point ``rlt_hal: acme``: the probe is cheap, the driver is built on demand."""

from hal import DriverSpec, ProbeResult, hookimpl


def _create(**options):
    from rlt_hal_acme.driver import create

    return create(**options)


@hookimpl
def rlt_hal_register_drivers():
    return [
        DriverSpec(
            "acme", lambda: ProbeResult(True), _create, "example third-party driver (host CPU)"
        )
    ]
