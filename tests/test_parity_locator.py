"""The divergence locator finds a planted difference at exactly its place."""

from __future__ import annotations

import json
import os

import pytest

from drivers.cpu.driver import CpuDevice, CpuDriver
from hal import DriverSpec, ProbeResult, Registry, hookimpl
from hal.eager import EagerBackend
from runtime_glue.llm import LLM
from runtime_glue.parity import compare
from tests.helpers import prompt_of, rlt_hal


class PerturbedBackend(EagerBackend):
    """Test double: cpu_eager, except the attention output of one plane is nudged."""

    name = "perturbed_eager"

    def __init__(self, plane: int, position: int) -> None:
        self.plane, self.position = plane, position

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        out = super().forward(query, plane, kv, meta, scaling, deterministic)
        if plane == self.plane:
            for r in range(meta.num_requests):
                start, query_len, context_len = meta.request(r)
                row = self.position - context_len
                if 0 <= row < query_len:
                    out[start + row] += 0.5
        return out


def _registry(plane: int, position: int) -> Registry:
    class Plugin:
        @hookimpl
        def rlt_hal_register_drivers(self):
            def create(**_):
                backend = PerturbedBackend(plane, position)
                return CpuDriver("perturbed", CpuDevice(), {backend.name: backend}, backend.name)

            return [DriverSpec("perturbed", lambda: ProbeResult(True), create)]

    return Registry(plugins=[Plugin()])


@pytest.mark.parametrize("loop, layer, position", [(0, 0, 0), (2, 1, 6), (3, 1, 12)])
def test_a_planted_difference_is_reported_at_its_loop_layer_and_op(
    tiny_ckpt, tiny_config, loop, layer, position
):
    plane = loop * tiny_config.num_hidden_layers + layer
    a = LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=8, deterministic=False)
    b = LLM(
        tiny_ckpt,
        device="perturbed",
        block_size=16,
        num_blocks=8,
        registry=_registry(plane, position),
        deterministic=False,
    )
    report = compare(a, b, prompt_of(10, seed=3), max_tokens=6)
    assert not report.equal
    d = report.first_divergence
    assert (d.loop, d.layer, d.op, d.position) == (loop, layer, "attention", position)
    assert d.max_abs_diff >= 0.25


def test_identical_drivers_are_reported_equal(tiny_ckpt, driver_name):
    a = LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=8, deterministic=False)
    b = LLM(tiny_ckpt, device=driver_name, block_size=16, num_blocks=8, deterministic=False)
    report = compare(a, b, prompt_of(10, seed=3), max_tokens=6)
    assert report.equal and report.first_divergence is None
    assert report.first_token_diff is None and report.max_logit_diff == 0.0


def _parity(ckpt, *args: str):
    """``rlt-hal parity --json`` on a five-token prompt, with the NPU emulated."""
    return rlt_hal(
        "parity",
        "--model",
        str(ckpt),
        "--prompt-ids",
        "5,6,7,8,9",
        "--block-size",
        "16",
        "--json",
        *args,
        env={**os.environ, "RLT_HAL_NPU_EMULATE": "1"},
    )


def test_the_cli_reports_json_and_exits_zero_when_equal(tiny_ckpt):
    proc = _parity(tiny_ckpt, "--device", "cpu", "--against", "npu", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["equal"] is True and report["b"].startswith("npu (emulated")
    assert len(report["tokens_a"]) == 4


def test_without_against_side_b_runs_on_side_as_device(tiny_ckpt):
    proc = _parity(tiny_ckpt, "--device", "npu", "--prefill-chunk-size", "2", "--max-tokens", "2")
    report = json.loads(proc.stdout)
    assert report["a"].startswith("npu (emulated") and report["b"].startswith("npu (emulated")
    assert report["b"].endswith("/chunk=2")
