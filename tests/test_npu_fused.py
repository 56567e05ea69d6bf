"""The fast plan on the emulated npu: the driver's fused kernels and ``ascend_fia`` admitted at
start-up on the EMULATED torch_npu (a test double for Ascend hardware), the plan built on them,
its bits and closeness against the exact plan, and its device-op count. The emulated ops
themselves: ``test_npu_emulated_ops``. Nothing here is a hardware result.
"""

from __future__ import annotations

import copy
import json
import os

import attrs
import pytest
import torch

from drivers.npu.driver import create
from drivers.npu.fused import AscendFiaBackend
from hal.graphs import StaticDecodeMetadata
from hal.kernels import Kernel, hf_rms_norm
from hal.types import AttentionMetadata
from runtime_glue.checks.parity import within_tolerance
from runtime_glue.engine.args import EngineArgs
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.admission import check_attention_backend, fast_plan
from runtime_glue.ouro.plan import OpChoice
from tests.helpers import prompt_of, rlt_hal

# -- the driver's kernels and backend, admitted on the device --------------------------------


@pytest.fixture(scope="module")
def emulated_npu():
    driver = create(emulate=True)
    driver.device.initialize()
    return driver


def test_ascend_fia_is_admitted_at_block_size_128_and_refused_at_16_saying_why(
    emulated_npu, tiny_config
):
    fia = emulated_npu.backend("ascend_fia")
    ok = check_attention_backend(fia, emulated_npu, tiny_config, 128)
    assert ok.admitted, ok.why
    assert ok.error is not None and ok.error < 0.2, ok.why
    refused = check_attention_backend(fia, emulated_npu, tiny_config, 16)
    assert not refused.admitted
    assert "block_size must be a multiple of 128" in refused.why


class _IgnoresBlockTable(AscendFiaBackend):
    """Test double: ascend_fia reading the blocks in order, as if the table were the identity."""

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        table = torch.arange(meta.block_tables.numel(), dtype=meta.block_tables.dtype)
        if isinstance(meta, StaticDecodeMetadata):  # the decode form
            meta = attrs.evolve(meta, block_tables=table.view(meta.block_tables.shape))
            return super().forward(query, plane, kv, meta, scaling)
        meta = AttentionMetadata(
            meta.block_size, meta.slot_mapping, table.view(meta.block_tables.shape),
            meta.seq_lens, meta.context_lens, meta.query_start_loc,
            meta.host_query_start_loc, meta.host_context_lens,
        )  # fmt: skip
        return super().forward(query, plane, kv, meta, scaling)


class _IgnoresDecodeMask(AscendFiaBackend):
    """Test double: ascend_fia whose decode form forgets the padding mask (reads the bucket)."""

    def _decode_view(self, meta):
        table, mask = super()._decode_view(meta)
        return table, torch.zeros_like(mask)


@pytest.mark.parametrize("planted", [_IgnoresBlockTable, _IgnoresDecodeMask])
def test_a_planted_attention_bug_is_refused_at_start_up(emulated_npu, tiny_config, planted):
    bad = check_attention_backend(planted(emulated_npu.device), emulated_npu, tiny_config, 128)
    assert not bad.admitted and "exceeds the float64 bound" in bad.why


@pytest.fixture(scope="module")
def fast_llm(tiny_ckpt):
    return LLM(tiny_ckpt, device="npu", driver_options={"emulate": True}, mode="fast",
               block_size=128, num_blocks=8)  # fmt: skip


def test_mode_fast_admits_every_fused_kernel_and_says_so(fast_llm):
    plan = fast_llm.plan
    assert plan.mode == "fast" and plan.attention == "ascend_fia"
    verdicts = {(a.op, a.kernel): a for a in plan.admissions}
    assert set(verdicts) == {
        ("rms_norm", "npu_rms_norm"), ("add_rms_norm", "npu_add_rms_norm"),
        ("silu_mul", "npu_swiglu"), ("rotary", "npu_rotary_mul"), ("attention", "ascend_fia"),
        ("step_graphs", "npu_graph (emulated)"),
    }  # fmt: skip
    graphs = verdicts.pop(("step_graphs", "npu_graph (emulated)"))
    assert graphs.admitted and "replay equals the eager step bit for bit" in graphs.why
    assert all(a.admitted and "within the float64 bound" in a.why for a in verdicts.values())
    assert plan.choice("generated", "rms_norm").kernel == "npu_rms_norm"
    assert dict(plan.fused) == {"add_rms_norm": "npu_add_rms_norm", "rotary": "npu_rotary_mul"}
    assert "npu_swiglu" in plan.describe()


def test_a_planted_bad_fused_kernel_is_refused_and_the_exact_kernel_kept(fast_llm):
    driver = create(emulate=True)
    bad = Kernel("rms_norm", "planted", lambda x, w, e: hf_rms_norm(x, w, e) * 1.03, fast_only=True)  # noqa: E501
    driver.kernels = tuple(k for k in driver.kernels if k.name != "npu_rms_norm") + (bad,)
    plan = fast_plan(driver, fast_llm.config, fast_llm.weights, None, None, 128)
    (verdict,) = [a for a in plan.admissions if a.kernel == "planted"]
    assert not verdict.admitted and "exceeds the float64 bound" in verdict.why
    assert plan.choice("prompt", "rms_norm").kernel == "torch"


def test_fast_mode_at_block_size_16_keeps_the_eager_backend_and_says_why(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="npu", driver_options={"emulate": True}, mode="fast",
              block_size=16, num_blocks=8)  # fmt: skip
    assert llm.plan.attention == "ascend_eager"
    (fia,) = [a for a in llm.plan.admissions if a.kernel == "ascend_fia"]
    assert not fia.admitted and "multiple of 128" in fia.why


def _greedy(llm, prompts, n=6):
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return llm.generate(prompts, params, return_logits=True)


PROMPTS = [prompt_of(150, seed=1), prompt_of(9, seed=2), prompt_of(1, seed=3)]


def test_the_fused_loop_with_torchs_kernels_gives_the_exact_plans_bits(fast_llm):
    # Only the grouping differs (each residual add fused with the norm after it); with torch's
    # forms in every slot, the fused loop is the exact plan bit for bit, in a batch.
    torch_only = tuple((op, OpChoice("torch")) for op, _ in fast_llm.plan.prompt)
    plan = attrs.evolve(
        fast_llm.plan, attention="ascend_eager", prompt=torch_only, generated=torch_only,
        fused=(("add_rms_norm", "torch"), ("rotary", "torch")),
    )  # fmt: skip
    fused = copy.copy(fast_llm)
    fused._build(plan)
    exact = fast_llm.variant(mode="hf-exact")
    for a, b in zip(_greedy(exact, PROMPTS), _greedy(fused, PROMPTS), strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)


def test_the_fast_plan_decodes_close_to_the_exact_plan_in_batches_and_prefill(fast_llm):
    exact = fast_llm.variant(mode="hf-exact")
    assert exact.plan.mode == "hf-exact" and exact.plan.attention == "ascend_eager"
    # Tolerance: on this random tiny model deterministic mode (the same arithmetic in another
    # rounding order) is itself 0.44 from HF-exact; the fused kernels must stay within 1.0,
    # as long as both runs are fed the same tokens.
    for a, b in zip(_greedy(exact, PROMPTS), _greedy(fast_llm, PROMPTS), strict=True):
        check = within_tolerance(a.token_ids, a.logits, b.token_ids, b.logits, 1.0)
        assert check.max_logit_diff <= 1.0, check
        assert check.max_logit_diff > 0  # not HF-exact, and not claimed to be


def test_mode_and_its_aliases_cannot_contradict_each_other(tiny_ckpt):
    with pytest.raises(ValueError, match="--mode fast contradicts --deterministic"):
        LLM(tiny_ckpt, device="cpu", mode="fast", deterministic=True, num_blocks=2)
    assert EngineArgs(mode="hf-exact").mode == "hf-exact"


@pytest.mark.parametrize(
    "speculation", [(), ("--speculative-loops", "1", "--num-speculative-tokens", "3")],
    ids=["plain", "speculative"],
)  # fmt: skip
def test_bench_ops_counts_fast_and_exact_plans_on_the_emulated_npu(tmp_path, speculation):
    """At Ouro-1.4B's depth (24 layers, 4 loops; tiny widths: a count does not depend on them),
    where a step's constant work weighs per layer pass as it does on the real model. With
    speculation every decode step is a draft or a verify step, each captured and replayed."""
    from runtime_glue.ouro.toy import preset_config, write_checkpoint

    deep = write_checkpoint(tmp_path / "deep", preset_config("tiny", num_hidden_layers=24))
    out = tmp_path / "ops.json"
    proc = rlt_hal(
        "bench", "ops", "--model", str(deep), "--device", "npu", "--mode", "fast",
        "--block-size", "128", *speculation, "--json", str(out),
        env={**os.environ, "RLT_HAL_NPU_EMULATE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    fast, exact = report["plan"], report["hf_exact"]
    assert report["emulated"] and "EMULATED" in proc.stdout
    assert fast["mode"] == "fast" and exact["mode"] == "hf-exact"
    assert fast["device_ops_per_layer_pass"] <= 20 < exact["device_ops_per_layer_pass"]
    assert "rlt_npu_emulated.npu_fused_infer_attention_score" in fast["top_ops"]
    # --mode fast captures decode steps where the driver offers graphs; HF-exact does not
    kinds = ("draft", "verify") if speculation else ("decode",)
    assert set(fast["by_step_kind"]) == set(kinds)
    calls = fast["host_calls_per_step_graph_replay"]
    assert set(calls) == set(kinds) and all(1 <= calls[k] <= 10 for k in kinds), calls
    assert exact["host_calls_per_step_graph_replay"] is None


def test_rlt_hal_plan_shows_each_admission(tiny_ckpt):
    proc = rlt_hal(
        "plan", "--model", str(tiny_ckpt), "--device", "npu", "--mode", "fast",
        env={**os.environ, "RLT_HAL_NPU_EMULATE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "attention ascend_fia: admitted, within the float64 bound" in proc.stdout
    assert "rotary npu_rotary_mul: admitted" in proc.stdout
    assert "step_graphs npu_graph (emulated): admitted" in proc.stdout
    assert "step graphs npu_graph (emulated) admitted" in proc.stdout  # the start-up line


def test_the_acceptance_fast_plan_part_fails_when_the_device_admits_nothing(tiny_ckpt):
    from runtime_glue.cli.acceptance import fast_plan_part

    llm = LLM(tiny_ckpt, device="npu", driver_options={"emulate": True}, num_blocks=8)
    planted = Kernel(
        "rms_norm", "planted", lambda x, w, e: hf_rms_norm(x, w, e) * 1.03, fast_only=True
    )  # noqa: E501
    llm.driver.kernels = (*(k for k in llm.driver.kernels if not k.fast_only), planted)
    llm.driver.fused_backends = {"ascend_fia": _IgnoresBlockTable(llm.driver.device)}
    part = fast_plan_part(llm, [], max_tokens=3, prompt_len=8, tolerance=0.5)
    assert not part.passed and part.details["admitted"] == []
    assert (
        len(part.details["refused"]) == 2
        and "exceeds the float64 bound" in part.details["refused"][0]
    )  # noqa: E501
