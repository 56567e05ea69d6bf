"""The divergence locator finds a planted difference at exactly its place."""

from __future__ import annotations

import json
import os

import pytest

from runtime_glue.checks.parity import compare
from runtime_glue.engine.llm import LLM
from tests.helpers import PerturbedBackend, prompt_of, registry_with, rlt_hal


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
        registry=registry_with(PerturbedBackend(plane, position)),
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
