"""The real torch_npu package, installed beside torch but without CANN: the state of a host
where the Ascend stack is missing or not sourced (``make test-torch-npu`` builds it).

These run only where torch_npu is installed; the main suite's environment has none. Each runs
rlt-hal in a fresh process, as a user would, since what matters is what ``import torch`` and
torch's backend auto-load do to that process. Nothing here is emulated.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is None,
    reason="needs the real torch-npu package beside torch: make test-torch-npu",
)


def _run(*args: str, **env_changes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_", "RLT_HAL_NPU"))}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)  # the test process set it: a user has not
    env.update(env_changes)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)


def test_this_host_reproduces_the_failure_import_torch_dies_on_auto_load():
    proc = _run("-c", "import torch")
    assert proc.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in proc.stderr


def test_drivers_exits_zero_and_lists_npu_as_unavailable_with_the_cann_message():
    proc = _run("-m", "runtime_glue.cli.main", "drivers")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "cpu      available" in lines["cpu"]
    assert "unavailable: CANN is not set up" in lines["npu"]
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in lines["npu"]


def test_generate_without_a_device_runs_on_the_cpu(tiny_ckpt):
    proc = _run(
        "-m",
        "runtime_glue.cli.main",
        "generate",
        "--model",
        str(tiny_ckpt),
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert '"device": "cpu"' in proc.stdout


def test_device_npu_says_to_source_set_env(tiny_ckpt):
    proc = _run(
        "-m",
        "runtime_glue.cli.main",
        "generate",
        "--model",
        str(tiny_ckpt),
        "--prompt-ids",
        "5,6",
        "--device",
        "npu",
    )
    assert proc.returncode == 2
    assert "device 'npu' (chosen by --device) is not available: CANN is not set up" in proc.stderr
    assert "set_env.sh" in proc.stderr and "Traceback" not in proc.stderr


def test_initialising_the_real_package_classifies_its_own_failure():
    # Past the probe: the real `import torch_npu` stops at CANN's libhccl.so.
    code = "from drivers.npu.driver import NpuDevice\nNpuDevice(0).initialize()"
    proc = _run("-c", code)
    assert proc.returncode != 0
    assert "RuntimeError: CANN is not set up (libhccl.so: cannot open shared object file" in (
        proc.stderr
    )


def test_a_library_user_imports_runtime_glue_before_torch_or_sets_the_variable():
    ok = _run("-c", "import runtime_glue, torch; print(torch.tensor([1]).device)")
    assert ok.returncode == 0 and "cpu" in ok.stdout, ok.stderr
    torch_first = _run("-c", "import torch, runtime_glue", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert torch_first.returncode == 0, torch_first.stderr


def test_the_hf_module_reference_says_why_transformers_cannot_load_here():
    # transformers' modeling code imports torch_npu whenever it is installed.
    proc = _run("-c", "import runtime_glue.checks.reference")
    assert proc.returncode != 0
    assert "the HF-module reference imports transformers' modeling code, which imports the " in (
        proc.stderr
    )
    assert "source CANN's set_env.sh where the Ascend stack is installed, or uninstall" in (
        proc.stderr
    )


def test_mode_fast_says_what_is_missing_as_device_npu_does(tiny_ckpt):
    on_npu = _run(
        "-m", "runtime_glue.cli.main", "plan", "--model", str(tiny_ckpt), "--device", "npu",
        "--mode", "fast",
    )  # fmt: skip
    assert on_npu.returncode == 2
    assert "device 'npu' (chosen by --device) is not available: CANN is not set up" in (
        on_npu.stderr
    )
    assert "Traceback" not in on_npu.stderr
    anywhere = _run(
        "-m", "runtime_glue.cli.main", "plan", "--model", str(tiny_ckpt), "--mode", "fast"
    )  # noqa: E501
    assert anywhere.returncode == 0, anywhere.stderr
    assert (
        "fast mode: cpu offers no fused kernels, so its fastest unfused ones run; unavailable here: "
        in (anywhere.stdout)
    )
    assert "npu (CANN is not set up" in anywhere.stdout and "set_env.sh" in anywhere.stdout
