"""The kit's pytest plugin (entry point ``pytest11: rlt_hal``): ``--rlt-driver NAME``.

Registered as a plugin rather than a conftest so that ``pytest --pyargs hal.testing`` knows
the option before it collects anything.
"""

from __future__ import annotations

import pytest

from hal.registry import default_registry


def pytest_addoption(parser):
    group = parser.getgroup("rlt-hal conformance")
    group.addoption(
        "--rlt-driver",
        action="append",
        default=[],
        metavar="NAME",
        help="driver to check (repeatable; default: cpu)",
    )


def pytest_generate_tests(metafunc):
    if "rlt_driver_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("--rlt-driver") or ["cpu"]
        metafunc.parametrize(
            "rlt_driver_name", names, ids=[f"driver={n}" for n in names], scope="module"
        )


@pytest.fixture(scope="module")
def driver(rlt_driver_name):
    drv = default_registry().create(rlt_driver_name)
    drv.device.initialize()
    return drv
