"""The NPU driver on the CPU: lazy import, actionable errors, ScatterND rules, fences.

torch_npu cannot exist here. Where a test needs "an installed torch_npu that fails in a known
way", it puts a stand-in package named torch_npu on sys.path (a test double, named as such).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.overrides import TorchFunctionMode

from drivers.npu.driver import NpuDevice, create
from drivers.npu.emulation import EmulatedTorchNpu
from hal.types import KVLayout
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import GREEDY, prompt_of, rlt_hal


def _stand_in_torch_npu(tmp_path, body: str):
    pkg = tmp_path / "stand_in" / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    return pkg.parent


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    def install(body):
        monkeypatch.syspath_prepend(str(_stand_in_torch_npu(tmp_path, body)))
        monkeypatch.delitem(sys.modules, "torch_npu", raising=False)

    yield install
    sys.modules.pop("torch_npu", None)


def test_probing_listing_and_selecting_cpu_never_import_torch_npu(tmp_path, tiny_ckpt):
    marker = tmp_path / "imported"
    path = _stand_in_torch_npu(tmp_path, f"open({str(marker)!r}, 'w').write('yes')\n")
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.getcwd()}"}
    env.pop("RLT_HAL_NPU_EMULATE", None)
    script = textwrap.dedent(f"""
        import sys, drivers.npu, drivers.npu.plugin, drivers.npu.driver
        from hal.registry import Registry
        reg = Registry()
        probes = dict((s.name, p) for s, p in reg.probe_all())
        npu = probes["npu"]  # found by find_spec, not imported; no CANN here
        assert not npu.available and "set_env.sh" in npu.reason, npu
        from runtime_glue.engine.llm import LLM
        LLM({str(tiny_ckpt)!r}, device="cpu", num_blocks=2).generate([[5, 6]])
        assert "torch_npu" not in sys.modules
    """)
    for cmd in (
        [sys.executable, "-c", script],
        [sys.executable, "-m", "runtime_glue.cli.main", "drivers"],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "torch_npu was imported"


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)
def test_without_torch_npu_initialize_says_how_to_find_the_release_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    version = torch.__version__.split("+")[0]
    with pytest.raises(
        RuntimeError,
        match=rf"torch_npu is not installed; install the torch-npu build for torch {version}: "
        r"`pip index versions torch-npu` lists them",
    ):
        NpuDevice(0).initialize()


def test_a_torch_npu_built_for_another_torch_names_both_versions(stand_in, monkeypatch):
    # A stand-in torch_npu (a test double) failing the way a mismatched build does.
    import importlib.metadata

    stand_in("raise ImportError('libtorch_npu.so: undefined symbol: _ZN3c104impl8GPUTrace')")
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda d: "2.12.0" if d == "torch-npu" else real(d)
    )
    version = torch.__version__.split("+")[0]
    with pytest.raises(
        RuntimeError,
        match=rf"torch_npu 2.12.0 was built for another torch than this torch {version} "
        r"\(libtorch_npu.so: undefined symbol: .*\); install the torch-npu build for torch",
    ):
        NpuDevice(0).initialize()


def test_a_missing_npu_driver_is_named_as_the_driver_not_cann(stand_in):
    stand_in("raise ImportError('libascend_hal.so: cannot open shared object file')")
    with pytest.raises(
        RuntimeError,
        match=r"the Ascend NPU driver is not installed or not on the library path "
        r"\(libascend_hal.so: .*\); install the Ascend NPU driver and firmware packages",
    ):
        NpuDevice(0).initialize()


def _ascend_host(tmp_path, *, toolkit=True, acl=True, driver=True, cards=(0, 1)):
    """A fake host layout for the probe (a test double: directories, empty files and device
    nodes as plain files): returns the environment and the /dev directory."""
    env, dev = {}, tmp_path / "dev"
    dev.mkdir()
    if toolkit:
        (tmp_path / "toolkit").mkdir()
        env["ASCEND_TOOLKIT_HOME"] = str(tmp_path / "toolkit")
    libs = tmp_path / "lib"
    libs.mkdir()
    env["LD_LIBRARY_PATH"] = str(libs)
    for name, present in (("libascendcl.so", acl), ("libascend_hal.so", driver)):
        if present:
            (libs / name).touch()
    for n in cards:
        (dev / f"davinci{n}").touch()
    (dev / "davinci_manager").touch()  # not a card
    return env, dev


@pytest.mark.parametrize(
    "missing, message",
    [
        (dict(toolkit=False), r"CANN is not set up .* source /usr/local/Ascend/ascend-toolkit"),
        (dict(acl=False), "libascendcl.so is not on LD_LIBRARY_PATH; source"),
        (dict(driver=False), r"NPU driver is not installed \(no libascend_hal.so\); install"),
        (dict(cards=()), r"no Ascend device is visible \(no .*/davinci<N> node"),
    ],
)
def test_the_probe_names_the_first_missing_part_of_the_stack(tmp_path, missing, message):
    from drivers.npu import environment

    env, dev = _ascend_host(tmp_path, **missing)
    why = environment.problem(env, dev)
    assert why is not None and re.search(message, why), why


def test_the_probe_passes_a_ready_host_and_honours_visible_devices(tmp_path):
    from drivers.npu import environment

    env, dev = _ascend_host(tmp_path)
    assert environment.problem(env, dev) is None
    assert environment.visible_devices(env, dev) == [0, 1]
    assert environment.visible_devices({**env, "ASCEND_RT_VISIBLE_DEVICES": "1"}, dev) == [1]
    hidden = {**env, "ASCEND_RT_VISIBLE_DEVICES": ""}
    assert "ASCEND_RT_VISIBLE_DEVICES=''" in environment.problem(hidden, dev)


def test_an_unsourced_cann_is_reported_with_the_set_env_command(stand_in):
    stand_in("raise OSError('libhccl.so: cannot open shared object file: No such file')")
    with pytest.raises(
        RuntimeError,
        match=r"CANN is not set up \(libhccl.so: cannot open .*\); "
        r"source /usr/local/Ascend/ascend-toolkit/set_env.sh",
    ):
        NpuDevice(0).initialize()


def test_no_visible_device_names_ascend_rt_visible_devices(stand_in, monkeypatch):
    stand_in("""
        import types, torch
        torch.npu = types.SimpleNamespace(device_count=lambda: 0, set_device=None,
                                          current_stream=None, Event=None, synchronize=None)
        npu_scatter_nd_update_ = None
    """)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch, "npu", None, raising=False)
    with pytest.raises(
        RuntimeError,
        match=r"no Ascend device is visible "
        r"\(ASCEND_RT_VISIBLE_DEVICES=''\)",
    ):
        NpuDevice(0).initialize()


def test_an_index_beyond_the_visible_devices_is_refused():
    with pytest.raises(RuntimeError, match=r"npu:3 requested but 1 device\(s\) are visible"):
        NpuDevice(3, emulate=True).initialize()


def test_reinitialising_after_fork_says_to_use_spawn(monkeypatch):
    device = NpuDevice(0, emulate=True)
    device.initialize()
    monkeypatch.setattr(os, "getpid", lambda: -1)
    with pytest.raises(RuntimeError, match="cannot be re-initialised after fork; .* 'spawn'"):
        device.initialize()


def test_the_current_stream_is_fetched_once_and_cached():
    device = NpuDevice(0, emulate=True)
    device.initialize()
    stream = device.stream
    assert device.ops.current_stream() is not stream  # a new object per call
    device.record_fence()
    assert device.stream is stream


# The rules, as torch_npu documents npu_scatter_nd_update_ (torch_npu/_op_plugin_docs.py of
# the 2.13.0 wheel): indices int32 or int64 and at least 2-D, their last dimension at most
# input's; updates.shape = indices.shape[:-1] + input.shape[k:]; input of 1 to 8 dimensions,
# float32, float16, bool, bfloat16, int64 or int8 on A2/A3, updates of the same dtype; no
# index out of range. The real op raises RuntimeError.
REFUSED = {
    "1-D indices": (lambda t: (torch.tensor([1]), t[1:2, 0]), "at least 2-D"),
    "int16 indices": (lambda t: (torch.tensor([[1]], dtype=torch.int16), t[:1]), "int32 or int64"),
    "int32 data": (lambda t: (torch.tensor([[1]]), t[:1].int()), "bfloat16, int64 or int8"),
    "updates of another dtype": (lambda t: (torch.tensor([[1]]), t[:1].half()), "input's dtype"),
    "indices deeper than input": (lambda t: (torch.tensor([[1, 0, 0, 0]]), t[:1]), "cannot exceed"),
    "misshaped updates": (lambda t: (torch.tensor([[1]]), t[:2]), r"must equal .* \[1, 2, 4\]"),
    "an index out of range": (lambda t: (torch.tensor([[9]]), t[:1]), "out of range"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_emulated_scatter_nd_refuses_what_torch_npus_documentation_rules_out(case):
    make, message = REFUSED[case]
    target = torch.zeros(8, 2, 4, dtype=torch.bfloat16)
    indices, updates = make(torch.ones(8, 2, 4, dtype=torch.bfloat16))
    data = target.int() if case == "int32 data" else target
    with pytest.raises(RuntimeError, match=f"{message}.*documented rule"):
        EmulatedTorchNpu().npu_scatter_nd_update_(data, indices, updates)
    assert not target.any(), "a refused update must not have written anything"


@pytest.mark.parametrize(
    "dtype, index_dtype, indices, updates_shape",
    [
        (torch.bfloat16, torch.int64, [[3], [5]], (2, 2, 4)),  # what the KV store writes
        (torch.bfloat16, torch.int32, [[3], [5]], (2, 2, 4)),
        (torch.int8, torch.int64, [[3, 1], [5, 0]], (2, 4)),  # k = 2: a row of plane 3
        (torch.bool, torch.int64, [[[1]], [[2]]], (2, 1, 2, 4)),  # 3-D indices
        (torch.float32, torch.int64, [[1], [1]], (2, 2, 4)),  # duplicates are not ruled out
    ],
)
def test_the_emulated_scatter_nd_accepts_what_the_documentation_allows(
    dtype, index_dtype, indices, updates_shape
):
    target = torch.zeros(8, 2, 4, dtype=dtype)
    idx = torch.tensor(indices, dtype=index_dtype)
    updates = torch.ones(updates_shape, dtype=dtype)
    EmulatedTorchNpu().npu_scatter_nd_update_(target, idx, updates)
    flat = idx.reshape(-1, idx.shape[-1]).long()
    assert all(target[tuple(i)].all() for i in flat.tolist())


def _store():
    driver = create(emulate=True)
    return driver.create_kv_store(KVLayout(3, 4, 16, 2, 8)), driver


def test_scatter_nd_writes_read_back_across_planes_and_pages():
    kv, driver = _store()
    slots = torch.tensor([15, 16, 17, 40, 63])  # crosses pages 0 -> 1 and lands in page 3
    rows = torch.randn(5, 2, 8).bfloat16()
    kv.write(1, rows, rows * 2, slots)
    k, v = kv.gather(1, slots)
    assert torch.equal(k[0].transpose(0, 1), rows) and torch.equal(v[0].transpose(0, 1), rows * 2)
    assert not kv.key_cache[0].any() and not kv.key_cache[2].any()
    assert driver.device.ops.scatter_calls == 2


def test_scatter_indices_are_built_and_validated_once_per_step():
    kv, _ = _store()
    slots = torch.tensor([3, 4])
    rows = torch.randn(2, 2, 8).bfloat16()
    kv.write(0, rows, rows, slots)
    first = kv.indices(slots)
    kv.write(2, rows, rows, slots)
    assert kv.indices(slots) is first and first.dtype == torch.int64 and first.shape == (2, 1)


@pytest.mark.parametrize(
    "requests, message",
    [
        ([(3, 0, [1]), (2, 0, [4])], r"slot mapping has a slot outside \[0, 64\): min 16, max 65"),
        ([(3, 0, [1]), (2, 0, [1])], "slot mapping writes one slot twice in a step"),
    ],
)
def test_bad_slot_mappings_are_refused_on_the_host_before_anything_is_written(requests, message):
    # The write path never reads the device to validate (that would wait for it every step):
    # a step's slots are checked on the host when its metadata is built.
    from hal.types import AttentionMetadata

    kv, driver = _store()
    with pytest.raises(IndexError, match=message):
        AttentionMetadata.build(16, requests, kv.layout.num_slots)
    assert driver.device.ops.scatter_calls == 0 and not kv.key_cache.any()


def _late_llm(tiny_ckpt):
    """Emulated events that never complete on their own: only a wait completes them."""
    return LLM(
        tiny_ckpt,
        device="npu",
        block_size=16,
        num_blocks=8,
        driver_options={"emulate": True, "event_delay": 10**9},
    )


def test_late_events_hold_freed_pages_until_the_device_has_finished(tiny_ckpt):
    llm = _late_llm(tiny_ckpt)
    params = SamplingParams(max_tokens=10, **GREEDY)  # 13 tokens: one page
    want = LLM(tiny_ckpt, block_size=16, num_blocks=8, deterministic=False).generate(
        [[5, 6, 7]], params
    )
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == want[0].token_ids
    assert llm.engine.num_free_blocks == 7, "pages came back before their step's event"
    llm.driver.device.synchronize()
    assert llm.engine.num_free_blocks == 8


class HostReads(TorchFunctionMode):
    """Records every call that turns a tensor into Python values (each a wait for the device
    when the tensor lives there), and on which tensor."""

    READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or (name in ("cpu", "to") and "cpu" in map(str, (*args, kwargs))):
            self.reads.append((name, id(args[0])))
        return func(*args, **(kwargs or {}))


def test_each_step_reads_the_device_once_where_it_needs_the_sampled_tokens(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="npu", block_size=16, num_blocks=16, prefill_chunk_size=8)
    eng, ops = llm.engine, llm.driver.device.ops
    copies = []
    to_host = ops.to_host
    ops.to_host = lambda t: copies.append(to_host(t)) or copies[-1]
    for i, n in enumerate((5, 19, 3)):  # prefill chunks, decodes, and both in one step
        eng.add_request(f"r{i}", prompt_of(n, seed=i), SamplingParams(max_tokens=6, **GREEDY))
    steps = 0
    with HostReads() as mode:
        while eng.has_unfinished():
            before = ops.host_copies
            eng.step()
            steps += 1
            assert ops.host_copies == before + 1, f"step {steps}"
    assert steps >= 8 and len(copies) == steps
    # Every read of a tensor in those steps was of the one host copy the step made.
    assert {i for _, i in mode.reads} <= {id(c) for c in copies}, mode.reads


def test_everything_the_emulated_driver_reports_says_emulated(tiny_ckpt):
    env = {**os.environ, "RLT_HAL_NPU_EMULATE": "1"}
    proc = rlt_hal(
        "generate",
        "--device",
        "npu",
        "--model",
        str(tiny_ckpt),
        "--prompt-ids",
        "5,6",
        "--max-tokens",
        "2",
        "--json",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"device": "npu (emulated torch_npu on CPU)"' in proc.stdout
    drivers = rlt_hal("drivers", env=env).stdout
    assert "npu      available: emulated" in drivers


def test_auto_never_picks_the_emulated_npu(monkeypatch):
    from hal.registry import Registry

    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    sel = Registry().select(None, env={})
    assert (
        sel.spec.name == "cpu"
        and ("npu", "emulated drivers are used only when chosen explicitly") in sel.skipped
    )


def test_device_npu_colon_one_selects_index_one(monkeypatch):
    from hal.registry import Registry

    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    driver = Registry().create("npu:1")
    assert driver.device.index == 1 and driver.device.emulated
    with pytest.raises(RuntimeError, match=r"npu:1 requested but 1 device\(s\) are visible"):
        driver.device.initialize()  # the emulation exposes one device, so index 1 is refused
