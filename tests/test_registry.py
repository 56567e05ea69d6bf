"""Driver discovery through entry points, and device selection."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from hal import DriverSpec, ProbeResult, Registry, hookimpl, parse_device


class _Plugin:
    def __init__(self, *specs):
        self.specs = list(specs)

    @hookimpl
    def rlt_hal_register_drivers(self):
        return self.specs


def _spec(name, available=True, reason=""):
    return DriverSpec(name, lambda: ProbeResult(available, reason), lambda **kw: (name, kw))


def _broken_probe():
    raise OSError("libfoo.so: cannot open shared object file")


def test_builtin_drivers_are_declared_as_rlt_hal_entry_points():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="rlt_hal")}
    assert eps["cpu"] == "drivers.cpu.plugin"
    assert {"cpu", "cuda", "npu"} <= set(eps)


def test_builtin_drivers_are_found_only_through_entry_points():
    assert Registry(load_entrypoints=False).names == []
    assert {"cpu", "cuda", "npu"} <= set(Registry().names)


def test_an_unknown_device_lists_the_known_drivers():
    with pytest.raises(
        ValueError, match=r"unknown device 'tpu'; known drivers: (.+, )?cpu, cuda, npu"
    ):
        Registry().select("tpu")


def test_an_unavailable_device_says_why():
    reg = Registry(
        plugins=[_Plugin(_spec("acme", False, "acme runtime not installed"))],
        load_entrypoints=False,
    )
    with pytest.raises(
        RuntimeError,
        match=r"'acme' \(chosen by --device\) is not available: "
        r"acme runtime not installed",
    ):
        reg.select("acme")


def test_a_probe_that_raises_makes_its_driver_unavailable_not_the_registry_broken():
    reg = Registry(
        plugins=[_Plugin(DriverSpec("bad", _broken_probe, lambda **kw: None))],
        load_entrypoints=False,
    )
    [(spec, probe)] = reg.probe_all()
    assert not probe.available and "libfoo.so" in probe.reason


def test_device_argument_beats_the_environment_variable_which_beats_auto():
    reg = Registry(plugins=[_Plugin(_spec("cpu"), _spec("acme"))], load_entrypoints=False)
    assert reg.select("acme", env={"VLLM_RLT_DEVICE": "cpu"}).spec.name == "acme"
    sel = reg.select(None, env={"VLLM_RLT_DEVICE": "acme:2"})
    assert (sel.spec.name, sel.index, sel.source) == ("acme", 2, "VLLM_RLT_DEVICE")
    assert reg.select(None, env={}).spec.name == "cpu"


def test_auto_skips_unavailable_candidates_and_records_why():
    reg = Registry(
        plugins=[_Plugin(_spec("npu", False, "no torch_npu"), _spec("cpu"))], load_entrypoints=False
    )
    sel = reg.select("auto", env={})
    assert sel.spec.name == "cpu" and sel.skipped == (("npu", "no torch_npu"),)


def test_two_plugins_cannot_claim_the_same_driver_name():
    with pytest.raises(RuntimeError, match="two plugins register a driver named 'cpu'"):
        Registry(plugins=[_Plugin(_spec("cpu")), _Plugin(_spec("cpu"))], load_entrypoints=False)


@pytest.mark.parametrize("text, want", [("cpu", ("cpu", None)), ("NPU:1", ("npu", 1))])
def test_parse_device(text, want):
    assert parse_device(text) == want


@pytest.mark.parametrize("text", ["", ":1", "npu:x", "npu:-1"])
def test_parse_device_rejects_malformed_names(text):
    with pytest.raises(ValueError, match="device"):
        parse_device(text)


def test_the_cli_lists_every_driver_with_its_availability():
    env = {k: v for k, v in os.environ.items() if k != "RLT_HAL_NPU_EMULATE"}
    out = subprocess.run(
        [sys.executable, "-m", "runtime_glue.cli.main", "drivers", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["cpu"]["available"] is True
    assert rows["npu"]["available"] is False and "torch_npu" in rows["npu"]["reason"]


def test_an_explicit_unknown_backend_fails_loudly(tiny_ckpt):
    from runtime_glue.engine.llm import LLM

    with pytest.raises(ValueError, match="'ascend_eager' is not offered by driver 'cpu'"):
        LLM(tiny_ckpt, device="cpu", attention_backend="ascend_eager")


def _install_broken_plugins(tmp_path):
    """Two broken plug-in distributions on a path, next to the installed ones (acme among
    them): one whose module fails to import, one whose hook raises."""
    (tmp_path / "needs_sdk.py").write_text("import acme_vendor_sdk  # not installed\n")
    (tmp_path / "raises_in_hook.py").write_text(
        "from hal import hookimpl\n\n\n@hookimpl\ndef rlt_hal_register_drivers():\n"
        "    raise RuntimeError('no licence for the widget accelerator')\n"
    )
    for dist, entry in (("needs-sdk", "needs_sdk"), ("raises-in-hook", "raises_in_hook")):
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[rlt_hal]\n{dist} = {entry}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}


def test_a_broken_plug_in_is_listed_with_its_error_and_the_others_still_work(tmp_path, tiny_ckpt):
    env = _install_broken_plugins(tmp_path)
    env.pop("RLT_HAL_NPU_EMULATE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "runtime_glue.cli.main", "drivers", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["cpu"]["available"] and rows["acme"]["available"]
    assert not rows["needs-sdk"]["available"]
    assert (
        "loading needs_sdk: ModuleNotFoundError: No module named 'acme_vendor_sdk'"
        in (rows["needs-sdk"]["reason"])
    )
    assert not rows["raises-in-hook"]["available"]
    assert "RuntimeError: no licence for the widget accelerator" in rows["raises-in-hook"]["reason"]
    # Asked for by name, a broken plug-in's driver says why; any other still generates.
    gen = [sys.executable, "-m", "runtime_glue.cli.main", "generate", "--model", str(tiny_ckpt)]
    gen += ["--prompt-ids", "5,6", "--max-tokens", "2"]
    bad = subprocess.run([*gen, "--device", "needs-sdk"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "its plug-in failed: loading needs_sdk" in bad.stderr
    ok = subprocess.run([*gen, "--device", "acme"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr


def test_a_hook_that_returns_something_else_than_driver_specs_is_a_broken_plug_in():
    class Confused:
        @hookimpl
        def rlt_hal_register_drivers(self):
            return ["cpu"]

    reg = Registry(plugins=[Confused(), _Plugin(_spec("cpu"))], load_entrypoints=False)
    probes = {spec.name: probe for spec, probe in reg.probe_all()}
    assert probes["cpu"].available
    [broken] = [p for name, p in probes.items() if name != "cpu"]
    assert "must return DriverSpec values" in broken.reason


def test_auto_passes_over_a_driver_that_fails_to_initialise():
    from drivers.cpu.driver import create as create_cpu

    class NoCard:
        def initialize(self):
            raise RuntimeError("no card answered")

    class Broken:
        device = NoCard()

    reg = Registry(
        plugins=[
            _Plugin(
                DriverSpec("npu", lambda: ProbeResult(True), lambda **kw: Broken()),
                DriverSpec("cpu", lambda: ProbeResult(True), lambda **kw: create_cpu()),
            )
        ],
        load_entrypoints=False,
    )
    assert reg.create("auto").name == "cpu"
    with pytest.raises(RuntimeError, match="no card answered"):
        reg.create("npu").device.initialize()  # chosen by name: its own error, no fallback
