"""Shared fixtures: hardware flags, toy checkpoints written once per session, the driver list."""

from __future__ import annotations

import os

import pytest

from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.toy import preset_config, write_checkpoint
from tests.server_helpers import ServerProcess


def pytest_addoption(parser):
    parser.addoption("--run-npu", action="store_true", help="run tests that need an Ascend NPU")
    parser.addoption("--run-cuda", action="store_true", help="run tests that need a CUDA GPU")


def pytest_configure(config):
    # Without real hardware the npu driver joins the cross-driver suite through its emulated
    # torch_npu (a test double); with --run-npu it is the real driver.
    if not config.getoption("--run-npu"):
        os.environ.setdefault("RLT_HAL_NPU_EMULATE", "1")


def pytest_generate_tests(metafunc):
    """``driver_name``: every driver that can run here; the suite runs once per driver."""
    if "driver_name" in metafunc.fixturenames:
        emulated = os.environ.get("RLT_HAL_NPU_EMULATE") == "1"
        names = available_drivers()
        ids = [f"{n}-emulated" if n == "npu" and emulated else n for n in names]
        metafunc.parametrize("driver_name", names, ids=ids)


def pytest_collection_modifyitems(config, items):
    for flag, marker in (("--run-npu", "npu"), ("--run-cuda", "cuda")):
        if config.getoption(flag):
            continue
        skip = pytest.mark.skip(reason=f"needs real hardware; enable with pytest {flag}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
    # Under pytest-xdist's --dist loadgroup (make test), a module's tests that use a fixture
    # of module scope (a server, a trained checkpoint) run in one worker, which builds it once.
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        if defs and any(d.scope == "module" for fd in defs.name2fixturedefs.values() for d in fd):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# name -> config overrides on top of the tiny preset. Widths, heads, GQA, head_dim, layers and
# loops vary; "wide*" have Ouro-1.4B's real width (hidden 2048, head_dim 128), where bf16
# kernel-path differences show up that tiny widths hide.
PARITY_CONFIGS = {
    "gqa-h64-d32-L2-T4": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        total_ut_steps=4,
    ),
    "mha-h96-d32-L1-T1": dict(
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=32,
        num_hidden_layers=1,
        total_ut_steps=1,
    ),
    "mqa-h128-d64-L2-T2": dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        num_hidden_layers=2,
        total_ut_steps=2,
    ),
    "gqa-h256-d32-L3-T4": dict(
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_hidden_layers=3,
        total_ut_steps=4,
    ),
    "mha-h128-d128-L1-T4": dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
        num_hidden_layers=1,
        total_ut_steps=4,
    ),
    "wide-h2048-d128-L1-T4": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        num_hidden_layers=1,
        total_ut_steps=4,
    ),
    "wide-gqa-h2048-d128-L2-T2": dict(
        hidden_size=2048,
        intermediate_size=2048,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        num_hidden_layers=2,
        total_ut_steps=2,
    ),
}


def skip_wide_on_emulation(name: str, driver_name: str) -> None:
    """Skip a realistic-width ("wide*") config on the emulated npu: its GEMMs and attention
    are torch's on this CPU, which the cpu driver's run of the same config covers, at several
    times the cost (90-125 s a test); the emulated npu runs every narrower config, head_dim 128
    included, and a real NPU (``--run-npu``) runs the wide ones too."""
    emulated = os.environ.get("RLT_HAL_NPU_EMULATE") == "1"
    if name.startswith("wide") and driver_name == "npu" and emulated:
        pytest.skip("wide configs run on cpu and on a real npu; the emulation runs the others")


class CheckpointFactory:
    """Writes each (name, overrides, seed) checkpoint once per test session."""

    def __init__(self, tmp_path_factory):
        self.tmp = tmp_path_factory
        self.cache = {}

    def __call__(self, name: str = "tiny", seed: int = 0, preset: str = "tiny", **overrides):
        key = (name, preset, seed, tuple(sorted(overrides.items())))
        if key not in self.cache:
            cfg = preset_config(preset, **overrides)
            path = self.tmp.mktemp(f"ckpt-{name}")
            write_checkpoint(path, cfg, seed=seed)
            self.cache[key] = path
        return self.cache[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    return CheckpointFactory(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_ckpt(checkpoints):
    return checkpoints("tiny")


@pytest.fixture(scope="session")
def tiny_config(tiny_ckpt) -> OuroConfig:
    return OuroConfig.from_dir(tiny_ckpt)


BUILTIN_DRIVERS = ("cpu", "cuda", "npu")


def available_drivers() -> list[str]:
    """Built-in drivers that can run here (third-party ones prove themselves with the kit)."""
    from hal.registry import default_registry

    return [
        spec.name
        for spec, probe in default_registry().probe_all()
        if probe.available and spec.name in BUILTIN_DRIVERS
    ]


@pytest.fixture(scope="module")
def default_server():
    """``rlt-hal serve`` on its default model (the embedded random toy checkpoint)."""
    proc = ServerProcess(None)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    """A real ``rlt-hal serve`` process on a loopback port, one per test module."""
    proc = ServerProcess(tiny_ckpt)
    yield proc
    proc.stop()
