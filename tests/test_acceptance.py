"""``rlt-hal acceptance`` and ``rlt-hal eval``: they run end to end on cpu and the emulated npu,
and each acceptance part fails when what it checks is broken (test-double drivers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hal.eager import EagerBackend
from runtime_glue.checks.evaluation import (
    LLMSide,
    ReferenceSide,
    evaluate,
    load_questions,
    normalize,
    sample_questions,
)
from runtime_glue.checks.reference import OuroReference
from runtime_glue.cli.acceptance import acceptance, closeness
from runtime_glue.engine.llm import LLM
from tests.helpers import PerturbedBackend, registry_with, rlt_hal

SMALL = dict(limit=4, max_tokens=6, prompt_len=20)


def _parts(report) -> dict[str, dict]:
    return {p["name"]: p for p in report["parts"]}


def test_acceptance_passes_on_the_emulated_npu_through_the_cli(tiny_ckpt, tmp_path):
    out, md = tmp_path / "report.json", tmp_path / "report.md"
    proc = rlt_hal(
        "acceptance",
        "--model",
        str(tiny_ckpt),
        "--device",
        "npu",
        "--limit",
        "4",
        "--max-tokens",
        "6",
        "--prompt-len",
        "20",
        "--json",
        str(out),
        "--markdown",
        str(md),
        env={**os.environ, "RLT_HAL_NPU_EMULATE": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and report["device"].startswith("npu (emulated")
    names = ["reference parity", "cross-device", "chunked prefill", "accuracy", "latency"]
    assert [p["name"] for p in report["parts"]] == [*names, "fast plan"]
    assert all(p["passed"] for p in report["parts"])
    fast = _parts(report)["fast plan"]["details"]  # the figures a 910B owner reads first
    assert "attention ascend_fia" in fast["admitted"] and not fast["refused"]
    assert fast["exact"]["tpot_over_floor"] > 0 and fast["fast"]["tpot_over_floor"] > 0
    assert fast["max_logit_diff"] > 0 and 0 <= fast["greedy_agreement"] <= 1  # not HF-exact
    assert fast["prompts"] == 4  # the question set (--limit 4)
    # A pass next to "outside the tolerance" says why: closeness is reported, not required.
    summary = _parts(report)["fast plan"]["summary"]
    assert ("outside" in summary) == (not fast["within_tolerance"])
    assert fast["within_tolerance"] or "reported only (a fast plan keeps no bits" in summary
    assert md.read_text().startswith(
        "# rlt-hal acceptance on npu (emulated torch_npu on CPU): PASSED"
    )


def test_a_fast_plan_outside_the_tolerance_says_it_is_reported_not_required():
    assert closeness(0.3, 0.5).endswith("(inside the tolerance 0.5)")
    outside = closeness(1.1, 0.5)
    assert "outside the tolerance 0.5, reported only" in outside
    assert "is not held to it" in outside


def test_acceptance_passes_on_the_cpu(tiny_ckpt):
    report = acceptance(tiny_ckpt, "cpu", **SMALL)
    assert report["passed"], [(p["name"], p["summary"]) for p in report["parts"]]


def test_a_driver_off_the_references_bits_fails_parity_and_accuracy(tiny_ckpt):
    report = acceptance(
        tiny_ckpt,
        "perturbed",
        registry=registry_with(PerturbedBackend(plane=3, position=None)),
        **SMALL,
    )
    parts = _parts(report)
    assert not report["passed"]
    assert not parts["reference parity"]["passed"]
    assert not parts["accuracy"]["passed"]
    assert "outputs identical to the reference's" in parts["accuracy"]["summary"]


def test_a_device_further_from_the_cpu_than_the_tolerance_fails_cross_device(tiny_ckpt):
    reg = registry_with(PerturbedBackend(plane=0, position=None, by=0.01))
    report = acceptance(tiny_ckpt, "perturbed", registry=reg, tolerance=1e-6, **SMALL)
    part = _parts(report)["cross-device"]
    assert not part["passed"] and "(tolerance 1e-06)" in part["summary"]


class ChunkAwareBackend(EagerBackend):
    """Test double: in deterministic mode, a row's bits depend on its request's chunk length."""

    name = "chunk_aware"

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        out = super().forward(query, plane, kv, meta, scaling, deterministic)
        if deterministic:
            for r in range(meta.num_requests):
                start, query_len, _ = meta.request(r)
                out[start : start + query_len] += 0.01 * query_len
        return out


def test_a_backend_whose_rows_depend_on_the_chunk_fails_chunked_prefill(tiny_ckpt):
    report = acceptance(
        tiny_ckpt, "chunky", registry=registry_with(ChunkAwareBackend(), "chunky"), **SMALL
    )
    parts = _parts(report)
    assert not parts["chunked prefill"]["passed"]
    assert parts["reference parity"]["passed"]  # HF-exact mode is unaffected
    assert (
        "a row computed alone differs from the same row in a chunk"
        in (parts["chunked prefill"]["summary"])
    )


def test_a_latency_run_that_cannot_run_fails_the_latency_part(tiny_ckpt):
    report = acceptance(tiny_ckpt, "cpu", limit=2, max_tokens=4, prompt_len=10**6)
    parts = _parts(report)
    assert (
        not parts["latency"]["passed"]
        and "exceeds the model's maximum length" in (parts["latency"]["summary"])
    )
    assert parts["reference parity"]["passed"]


# -- rlt-hal eval ---------------------------------------------------------------------------


def test_the_shipped_question_set_loads(tmp_path):
    questions = load_questions(sample_questions())
    assert len(questions) >= 30 and len({q.id for q in questions}) == len(questions)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "question": "q?", "answers": ["a"]}\n{"id": 2, "question": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'question' is missing"):
        load_questions(bad)


@pytest.mark.parametrize(
    "text, want", [("The Pacific Ocean.", "pacific ocean"), ("  Forty-two!", "fortytwo")]
)
def test_answers_are_compared_normalised(text, want):
    assert normalize(text) == want


def test_eval_scores_each_side_and_counts_agreement(tiny_ckpt, tmp_path):
    llm = LLM(tiny_ckpt, device="cpu", deterministic=False, num_blocks=32, block_size=16)
    reference = OuroReference(llm.config).load(tiny_ckpt)
    questions = load_questions(sample_questions())[:3]
    first = evaluate(llm.tokenizer, questions, LLMSide(llm), ReferenceSide(reference, "cpu"))
    assert first["identical_outputs"] == 3  # HF-exact mode: the reference's very tokens
    # Questions whose answer is what both sides say: scored right; another answer: wrong.
    right = first["results"][0]["output_a"]
    lines = [
        {"id": "r", "question": questions[0].question, "answers": [right or "-"]},
        {"id": "w", "question": questions[1].question, "answers": ["not this"]},
    ]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    report = evaluate(
        llm.tokenizer, load_questions(path), LLMSide(llm), ReferenceSide(reference, "cpu")
    )
    assert [r["correct_a"] for r in report["results"]] == [bool(right), False]
    assert report["agreement"]["both_wrong"] == 1 + (not right)
    assert report["accuracy_a"] == report["accuracy_b"]


def test_the_eval_cli_writes_a_report_against_the_reference(tiny_ckpt, tmp_path):
    out = tmp_path / "eval.json"
    proc = rlt_hal(
        "eval",
        "--model",
        str(tiny_ckpt),
        "--device",
        "cpu",
        "--limit",
        "3",
        "--max-tokens",
        "5",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["questions"] == 3 and report["b"].startswith("HF-module reference")
    assert "| 3 |" in proc.stdout and all("tokens_a" in r for r in report["results"])
    assert isinstance(report["results"][0]["tokens_a"], list)
    assert torch.tensor(report["results"][0]["tokens_a"]).dtype == torch.int64


def test_acceptance_defaults_to_the_embedded_checkpoint_and_the_auto_device(
    monkeypatch, tmp_path, capsys
):
    """Its --help gives --model and --device defaults; they work (no argparse "required")."""
    from runtime_glue.cli import acceptance as part
    from runtime_glue.cli.main import main
    from runtime_glue.ouro import toy

    seen = {}

    def record(model, device, **_):
        seen.update(model=model, device=device)
        return {"device": "cpu", "model": str(model), "passed": True, "parts": []}

    monkeypatch.setattr(part, "acceptance", record)
    monkeypatch.setattr(toy, "cached_checkpoint", lambda preset: tmp_path / preset)
    assert main(["acceptance", "--preset", "tiny"]) == 0
    assert seen == {"model": tmp_path / "tiny", "device": None}
    assert "RANDOM weights" in capsys.readouterr().err
