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


# The second tier (``make test-slow``; CI runs both, make test runs the rest): the
# realistic-width ("wide-*") configs, the modules that train a checkpoint, run the benches or
# fuzz and time servers, and each test that took 5 s or more on the 2-core Zen 1 machine
# (call or setup, 2026-12-06) where a faster test of the same guarantee stays in make test.
SLOW_MODULES = {
    "test_acceptance",
    "test_bench",
    "test_kv_sharing_bench",
    "test_server_fuzz",
    "test_server_lifecycle",
    "test_trained",
}
SLOW_TESTS = {
    "test_checkpoint.py::test_processes_that_write_the_embedded_checkpoint_together_all_get_a_whole_one",
    "test_cli.py::test_generate_json_reports_the_same_tokens_as_the_python_api",
    "test_cli.py::test_run_uses_the_embedded_random_checkpoint_and_says_so",
    "test_conformance_kit.py::test_the_example_driver_is_selected_with_vllm_rlt_device",
    "test_conformance_kit.py::test_the_example_driver_passes_the_kit",
    "test_exits.py::test_a_batch_mixing_modes_keeps_each_requests_own",
    "test_exits.py::test_generate_shows_each_tokens_exit_loop_as_the_api_numbers_it",
    "test_kv_sharing_server.py::test_a_sharing_server_serves_four_long_generations_at_once_without_preemption",
    "test_npu_driver.py::test_everything_the_emulated_driver_reports_says_emulated",
    "test_npu_driver.py::test_probing_listing_and_selecting_cpu_never_import_torch_npu",
    "test_npu_fused.py::test_bench_ops_counts_fast_and_exact_plans_on_the_emulated_npu",
    "test_npu_fused.py::test_rlt_hal_plan_shows_each_admission",
    "test_npu_fused.py::test_the_acceptance_fast_plan_part_fails_when_the_device_admits_nothing",
    "test_parity_locator.py::test_the_cli_reports_json_and_exits_zero_when_equal",
    "test_plan_record.py::test_two_cpu_engines_agree_when_the_first_chose_its_kernels_on_a_busy_machine",
    "test_prefix_cache.py::test_the_server_shares_prefixes_preempts_and_shows_both_in_its_metrics",
    "test_registry.py::test_a_broken_plug_in_is_listed_with_its_error_and_the_others_still_work",
    "test_responses.py::test_odd_values_of_every_field_are_answered_without_a_server_error",
    "test_sampling_stage.py::test_json_schema_outputs_always_parse_and_validate_while_sampling",
    "test_server.py::test_an_api_key_is_required_when_configured",
    "test_server.py::test_sigterm_finishes_in_flight_requests_and_exits_zero",
    "test_server_requests.py::test_max_model_len_caps_requests_and_chat_runs_to_it_by_default",
    "test_server_requests.py::test_vllms_chat_template_fields_render_as_tokenize_renders_them",
    "test_server_structured.py::test_on_the_default_model_parse_and_a_required_call_succeed_every_time",
    "test_speculative.py::test_a_speculative_server_answers_as_plain_decoding_and_counts_its_drafts",
    "test_speculative.py::test_bench_speculative_counts_host_calls_per_token_under_step_graphs",
    "test_speculative.py::test_bench_speculative_reports_the_grid_against_plain_decoding",
    "test_speculative.py::test_in_hf_exact_mode_speculation_keeps_the_batching_tolerance",
    "test_step_graphs.py::test_replay_equals_eager_across_preemption",
}


def _slow(item) -> bool:
    module = item.module.__name__.rsplit(".", 1)[-1]
    return (
        module in SLOW_MODULES
        or f"{module}.py::{item.originalname}" in SLOW_TESTS
        or "wide-" in item.name
    )


def _mark_slow(items) -> None:
    """Mark the second tier ``slow``; with the whole suite collected, a name in SLOW_TESTS or
    SLOW_MODULES that matches nothing is an error (a renamed test would leave the tier)."""
    seen: set[str] = set()
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        seen.update((module, f"{module}.py::{item.originalname}"))
        if _slow(item):
            item.add_marker(pytest.mark.slow)
    stale = (SLOW_MODULES | SLOW_TESTS) - seen
    if len({i.module.__name__ for i in items}) > 40 and stale:
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist: {sorted(stale)}")


def pytest_collection_modifyitems(config, items):
    _mark_slow(items)
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
def tool_server(tiny_ckpt, tmp_path_factory):
    """A server on the tiny checkpoint with a chat template that renders tools (Hermes'
    manner): tool_choice 'auto' runs there and parses the calls the model writes."""
    from tests.helpers import with_tool_template

    proc = ServerProcess(with_tool_template(tiny_ckpt, tmp_path_factory.mktemp("tools")))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    """A real ``rlt-hal serve`` process on a loopback port, one per test module (logging its
    requests, as a deployment would)."""
    proc = ServerProcess(tiny_ckpt, "--enable-log-requests")
    yield proc
    proc.stop()
