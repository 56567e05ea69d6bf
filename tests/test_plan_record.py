"""Deterministic mode between engines: the kernel choice is made once and recorded.

Timings move with the machine's load; a request's bits must not. The first engine of a
machine, model shape and plan flags measures and records its kernel choice
(``runtime_glue.ouro.plan_record``); every later engine reuses it, after the start-up check.
These tests control the timings with a plug-in driver whose two projection kernels give
different bits, so they fail on a CPU with one kernel per op as on one with several.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = [prompt_of(9, seed=1), prompt_of(21, seed=2)]


def _two_kernel_engine_kw(monkeypatch, tmp_path, slow: dict[str, float]):
    """LLM keyword arguments for a cpu driver whose projections have exactly two kernels:
    "steady" (F.linear, a millisecond a call) and "swift" (F.linear + 1: other bits, and as
    slow as ``slow["swift"]`` seconds a call, the load the test puts on it)."""
    from drivers.cpu.driver import CpuDevice, CpuDriver, CpuEagerBackend
    from hal import DriverSpec, Kernel, ProbeResult, Registry, hookimpl

    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))

    def steady(x, w):
        time.sleep(0.001)
        return F.linear(x, w)

    def swift(x, w):
        if slow["swift"]:
            time.sleep(slow["swift"])
        return F.linear(x, w) + 1

    class Plugin:
        @hookimpl
        def rlt_hal_register_drivers(self):
            def create(**_):
                kernels = [Kernel("linear", "steady", steady), Kernel("linear", "swift", swift)]
                driver = CpuDriver(
                    "two", CpuDevice(), {"cpu_eager": CpuEagerBackend()}, "cpu_eager", kernels
                )
                # Only the two: torch's F.linear would be a third candidate.
                driver.kernels = tuple(
                    k for k in driver.kernels if (k.op, k.name) != ("linear", "torch")
                )
                return driver

            return [DriverSpec("two", lambda: ProbeResult(True), create)]

    registry = Registry(plugins=[Plugin()], load_entrypoints=False)
    return dict(device="two", registry=registry, num_blocks=16, deterministic=True)


def _linear_kernels(plan) -> set[str]:
    return {c.kernel for kind in (plan.prompt, plan.generated) for op, c in kind if "proj" in op}


def _bits(llm):
    return [(o.token_ids, o.logits) for o in llm.generate(PROMPTS, PARAMS, return_logits=True)]


def _same_bits(a, b) -> bool:
    return all(ta == tb and torch.equal(la, lb) for (ta, la), (tb, lb) in zip(a, b, strict=True))


def test_an_engine_built_under_other_timings_keeps_the_recorded_choice_and_the_bits(
    tiny_ckpt, monkeypatch, tmp_path
):
    slow = {"swift": 0.02}  # "swift" is loaded while the first engine chooses: 20x "steady"
    kw = _two_kernel_engine_kw(monkeypatch, tmp_path, slow)
    first = LLM(tiny_ckpt, **kw)
    assert _linear_kernels(first.plan) == {"steady"}
    slow["swift"] = 0.0  # the load is gone: "swift" now times faster than "steady"
    second = LLM(tiny_ckpt, **kw)
    assert second.plan.prompt == first.plan.prompt
    assert second.plan.generated == first.plan.generated
    assert _same_bits(_bits(second), _bits(first))
    assert "measured now (none recorded" in first.plan.notes[-1]
    assert "kernels as recorded in" in second.plan.notes[-1]


def test_the_process_keeps_its_choice_when_the_record_file_is_gone(
    tiny_ckpt, monkeypatch, tmp_path
):
    slow = {"swift": 0.02}
    kw = _two_kernel_engine_kw(monkeypatch, tmp_path, slow)
    first = LLM(tiny_ckpt, **kw)
    shutil.rmtree(tmp_path / "plans")
    slow["swift"] = 0.0
    second = LLM(tiny_ckpt, **kw)
    assert _linear_kernels(second.plan) == _linear_kernels(first.plan) == {"steady"}


def test_remeasuring_is_explicit_and_says_the_choice_was_measured_again(
    tiny_ckpt, monkeypatch, tmp_path
):
    slow = {"swift": 0.02}
    kw = _two_kernel_engine_kw(monkeypatch, tmp_path, slow)
    first = LLM(tiny_ckpt, **kw)
    slow["swift"] = 0.0
    again = LLM(tiny_ckpt, remeasure_plan=True, **kw)
    assert "swift" in _linear_kernels(again.plan)
    assert "kernels measured now (asked to (--remeasure-plan)" in again.plan.notes[-1]
    assert not _same_bits(_bits(again), _bits(first))  # why re-measuring must be explicit
    later = LLM(tiny_ckpt, **kw)  # the new choice is the record now
    assert later.plan.generated == again.plan.generated
    assert "kernels as recorded in" in later.plan.notes[-1]


def test_a_recorded_choice_that_fails_the_start_up_check_is_measured_again_and_says_why(
    tiny_ckpt, monkeypatch, tmp_path
):
    slow = {"swift": 0.02}
    kw = _two_kernel_engine_kw(monkeypatch, tmp_path, slow)
    LLM(tiny_ckpt, **kw)
    from runtime_glue.ouro import plan_record

    [raw] = [r for p, r in plan_record._REMEMBERED.items() if p.is_relative_to(tmp_path)]
    for ops in raw["chosen"].values():  # a record naming a kernel the driver lacks
        ops["qkv_proj"]["kernel"] = "no-such-kernel"
    again = LLM(tiny_ckpt, **kw)
    assert (
        "failed its start-up check (qkv_proj: linear kernel 'no-such-kernel'"
        in (again.plan.notes[-1])
    )


def test_the_start_up_lines_say_where_the_choice_is_kept_and_whether_it_was_measured_now(
    tiny_ckpt, monkeypatch, tmp_path, capsys
):
    from runtime_glue.engine.args import EngineArgs
    from runtime_glue.engine.llm import build_llm

    kw = _two_kernel_engine_kw(monkeypatch, tmp_path, {"swift": 0.0})
    registry = kw.pop("registry")
    args = EngineArgs(model=str(tiny_ckpt), **kw)
    build_llm(args, announce=True, registry=registry)
    plan_line, note, *_ = capsys.readouterr().err.splitlines()
    assert plan_line.startswith("two: deterministic mode")
    assert note.startswith("  kernels measured now (none recorded; ")
    assert f"recorded in {tmp_path / 'plans'}" in note
    build_llm(args, announce=True, registry=registry)
    _, note, *_ = capsys.readouterr().err.splitlines()
    assert note.startswith(f"  kernels as recorded in {tmp_path / 'plans'}")


_BURN = "import time\nend = time.time() + 120\nwhile time.time() < end: pass\n"


def test_two_cpu_engines_agree_when_the_first_chose_its_kernels_on_a_busy_machine(
    checkpoints, monkeypatch, tmp_path
):
    """The issue's reproduction: an empty cache, two CPU-burning processes while the first
    engine chooses its kernels, the second built on an idle machine; at Ouro-1.4B's width,
    where a CPU with avx512_bf16 has several kernels per op."""
    name = "wide-gqa-h2048-d128-L2-T2"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))
    burners = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(2)]
    try:
        busy = LLM(ckpt, device="cpu", block_size=16, num_blocks=64, deterministic=True)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    idle = LLM(ckpt, device="cpu", block_size=16, num_blocks=64, deterministic=True)
    assert (idle.plan.prompt, idle.plan.generated) == (busy.plan.prompt, busy.plan.generated)
    batched = busy.generate(PROMPTS, PARAMS, return_logits=True)
    for prompt, b in zip(PROMPTS, batched, strict=True):
        [alone] = idle.generate([prompt], PARAMS, return_logits=True)
        assert alone.token_ids == b.token_ids and torch.equal(alone.logits, b.logits)
