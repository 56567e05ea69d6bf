"""``rlt-hal acceptance``: one command that tells a user whether a device serves Ouro correctly.

Five parts, each passed or failed, in one JSON and markdown report:

- **reference parity**: in HF-exact mode, rlt-hal's greedy tokens and final-loop logits equal,
  bit for bit, those of the HF-module reference run on the same device (the method of the
  project's seed: the reference and rlt-hal share the device's own kernels).
- **cross-device**: the same prompts on the cpu, held to a stated tolerance: devices' kernels
  round differently, so bits cannot be asked for across devices.
- **chunked prefill**: in deterministic mode on the device, prefilling in chunks gives the bits
  of full prefill.
- **accuracy**: ``rlt-hal eval`` of rlt-hal against the reference on the device: every question
  gets the same output from both.
- **latency**: ``rlt-hal bench latency`` on the device: its figures against their floors.
- **fast plan** (``--mode fast``, where the driver offers fused kernels): which fused kernels
  the device admitted; TPOT and TPOT/floor of the exact and the fast plan; the fast plan's
  largest logit difference from the exact plan (while both are fed the same tokens) and its
  greedy-token agreement on the question set. It passes when the device admitted a fused
  kernel and every figure was measured; whether the logits stayed within ``--tolerance`` is
  reported, not required: a fast plan keeps no bits, and on a random toy checkpoint even
  deterministic mode (another correct rounding order) moves logits by about as much.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable

import attrs
import torch

from runtime_glue.checks.evaluation import LLMSide, ReferenceSide, evaluate, load_questions
from runtime_glue.checks.parity import within_tolerance
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

DEFAULT_TOLERANCE = 0.5  # |logit| difference across devices, while fed the same tokens
PARITY_PROMPT = 40  # tokens of the random prompt the parity parts run, besides a sentence


@attrs.frozen
class Part:
    name: str
    passed: bool
    summary: str
    details: dict = attrs.field(factory=dict)


def _prompts(llm: LLM) -> list[list[int]]:
    text = llm.encode("The capital of France is")
    gen = torch.Generator().manual_seed(PARITY_PROMPT)
    vocab = llm.config.vocab_size
    return [text, torch.randint(3, vocab, (PARITY_PROMPT,), generator=gen).tolist()]


def _greedy(llm: LLM, prompt: list[int], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, return_logits=True)[0]


def reference_parity(llm: LLM, reference, prompts, max_tokens: int) -> Part:
    rows = []
    for prompt in prompts:
        out = _greedy(llm, prompt, max_tokens)
        tokens, logits = reference.generate(prompt, max_tokens)
        diff = float((out.logits - logits.cpu()).abs().max())
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "tokens_equal": list(out.token_ids) == tokens,
                "max_logit_diff": diff,
            }
        )
    passed = all(r["tokens_equal"] and r["max_logit_diff"] == 0.0 for r in rows)
    worst = max(r["max_logit_diff"] for r in rows)
    summary = f"{len(rows)} prompts, largest logit difference {worst:.4g} (0 expected)"
    return Part("reference parity", passed, summary, {"prompts": rows})


def cross_device(llm: LLM, cpu: LLM, prompts, max_tokens: int, tolerance: float) -> Part:
    rows = []
    for prompt in prompts:
        a, b = _greedy(cpu, prompt, max_tokens), _greedy(llm, prompt, max_tokens)
        check = within_tolerance(a.token_ids, a.logits, b.token_ids, b.logits, tolerance)
        rows.append(attrs.asdict(check))
    worst = max(r["max_logit_diff"] for r in rows)
    summary = f"largest logit difference from cpu {worst:.4g} (tolerance {tolerance})"
    return Part("cross-device", all(r["passed"] for r in rows), summary, {"prompts": rows})


def chunked_prefill(llm: LLM, prompts, max_tokens: int, chunk: int) -> Part:
    det = llm.variant(deterministic=True)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    full = det.generate(prompts, params, return_logits=True)
    det.engine.config = attrs.evolve(det.engine.config, prefill_chunk_size=chunk)
    chunked = det.generate(prompts, params, return_logits=True)
    same = [
        f.token_ids == c.token_ids
        and f.logits is not None
        and c.logits is not None
        and torch.equal(f.logits, c.logits)
        for f, c in zip(full, chunked, strict=True)
    ]
    summary = f"deterministic mode, chunks of {chunk}: {sum(same)}/{len(same)} prompts bit-equal"
    return Part("chunked prefill", all(same), summary, {"chunk": chunk, "bit_equal": same})


def accuracy(llm: LLM, reference, questions, max_tokens: int) -> Part:
    report = evaluate(
        llm.tokenizer,
        questions,
        LLMSide(llm),
        ReferenceSide(reference, "device"),
        max_tokens=max_tokens,
    )
    n, same = report["questions"], report["identical_outputs"]
    summary = (
        f"{same}/{n} outputs identical to the reference's; accuracy "
        f"{report['accuracy_a']:.1%} (rlt-hal), {report['accuracy_b']:.1%} (reference)"
    )
    return Part("accuracy", same == n, summary, {"evaluation": report})


def latency_part(llm: LLM, prompt_len: int, output_len: int) -> Part:
    from runtime_glue.bench.engine_bench import latency, markdown_latency

    llm.engine.validate([3] * prompt_len, SamplingParams(max_tokens=output_len))  # first
    report = latency(llm, [prompt_len], output_len, runs=1, warmup=0)
    row = report["results"][0]
    figures = [row["ttft_s"]["p50"], row["tpot_s"]["p50"], row["tpot_over_decode_floor"]]
    ok = all(math.isfinite(x) and x > 0 for x in figures)
    summary = (
        f"{prompt_len} prompt tokens: TTFT {row['ttft_s']['p50']:.3f} s, TPOT "
        f"{row['tpot_s']['p50']:.3f} s ({row['tpot_over_decode_floor']:.2f}x the floor)"
    )
    return Part("latency", ok, summary, {"latency": report, "table": markdown_latency(report)})


def _tpot(llm: LLM, prompt_len: int, output_len: int) -> dict:
    from runtime_glue.bench.engine_bench import latency

    row = latency(llm, [prompt_len], output_len, runs=1, warmup=0)["results"][0]
    return {"tpot_s": row["tpot_s"]["p50"], "tpot_over_floor": row["tpot_over_decode_floor"]}


def closeness(worst: float, tolerance: float) -> str:
    """The fast plan's largest logit difference from the exact plan's, against ``tolerance``.
    Outside it the part still passes (a fast plan keeps no bits, and on a random toy even
    deterministic mode moves logits about as far), so the summary says that it is not held to
    it, next to the figure."""
    if worst <= tolerance:
        return f"logits within {worst:.4g} of the exact plan's (inside the tolerance {tolerance})"
    return (
        f"logits within {worst:.4g} of the exact plan's: outside the tolerance {tolerance}, "
        "reported only (a fast plan keeps no bits and is not held to it; docs/ascend.md)"
    )


def fast_plan_part(llm: LLM, questions, max_tokens: int, prompt_len: int, tolerance: float) -> Part:
    from runtime_glue.checks.evaluation import DEFAULT_TEMPLATE

    fast = llm.variant(mode="fast")
    kernels = [a for a in fast.plan.admissions if a.op != "step_graphs"]
    admitted = [f"{a.op} {a.kernel}" for a in kernels if a.admitted]
    refused = [f"{a.op} {a.kernel}: {a.why}" for a in kernels if not a.admitted]
    graphs = next((a for a in fast.plan.admissions if a.op == "step_graphs"), None)
    graphs_verdict = (
        "off" if graphs is None else f"{'admitted' if graphs.admitted else 'refused'}: {graphs.why}"
    )
    prompts = [
        llm.encode(DEFAULT_TEMPLATE.format(question=q.question)) for q in questions
    ] or _prompts(llm)
    worst, agree, total = 0.0, 0, 0
    for prompt in prompts:
        a, b = _greedy(llm, prompt, max_tokens), _greedy(fast, prompt, max_tokens)
        check = within_tolerance(a.token_ids, a.logits, b.token_ids, b.logits, tolerance)
        worst = max(worst, check.max_logit_diff)
        agree += sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=False))
        total += len(a.token_ids)
    exact_t, fast_t = _tpot(llm, prompt_len, max_tokens), _tpot(fast, prompt_len, max_tokens)
    summary = (
        f"{len(admitted)} fused kernels admitted; step graphs {graphs_verdict.split(':')[0]}; "
        f"TPOT {exact_t['tpot_s'] * 1e3:.1f} ms "
        f"({exact_t['tpot_over_floor']:.1f}x floor) exact, {fast_t['tpot_s'] * 1e3:.1f} ms "
        f"({fast_t['tpot_over_floor']:.1f}x floor) fast; {closeness(worst, tolerance)}; "
        f"greedy tokens agree {agree}/{total}"
    )
    details = {
        "plan": fast.plan.describe(),
        "admitted": admitted,
        "refused": refused,
        "step_graphs": graphs_verdict,
        "exact": {"plan": llm.plan.describe(), **exact_t},
        "fast": {"plan": fast.plan.describe(), **fast_t},
        "max_logit_diff": worst,
        "within_tolerance": worst <= tolerance,
        "greedy_agreement": agree / total if total else 1.0,
        "prompts": len(prompts),
    }
    figures = [exact_t["tpot_over_floor"], fast_t["tpot_over_floor"], worst]
    measured = all(math.isfinite(x) for x in figures) and total > 0
    return Part("fast plan", bool(admitted) and measured, summary, details)


def _guarded(name: str, run: Callable[[], Part]) -> Part:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a part that cannot run has failed, and says why
        return Part(
            name, False, f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()}
        )


def acceptance(
    model,
    device: str | None,
    *,
    registry=None,
    questions_path=None,
    limit: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    max_tokens: int = 16,
    prompt_len: int = 64,
    chunk: int = 16,
) -> dict:
    """Every part on ``device`` (None: ``$VLLM_RLT_DEVICE``, else auto); ``registry`` selects
    drivers (tests pass test doubles)."""
    from runtime_glue.bench.engine_bench import machine
    from runtime_glue.checks.evaluation import sample_questions
    from runtime_glue.checks.reference import OuroReference

    llm = LLM(model, device=device, registry=registry, deterministic=False)
    dev = llm.driver.device.torch_device
    reference = OuroReference(llm.config).load(llm.model_dir).to(dev)
    prompts = _prompts(llm)
    questions = load_questions(questions_path or sample_questions())[:limit]
    parts = [
        _guarded("reference parity", lambda: reference_parity(llm, reference, prompts, max_tokens)),
        _guarded(
            "cross-device",
            lambda: cross_device(
                llm, LLM(model, device="cpu", deterministic=False), prompts, max_tokens, tolerance
            ),
        ),
        _guarded("chunked prefill", lambda: chunked_prefill(llm, prompts, max_tokens, chunk)),
        _guarded("accuracy", lambda: accuracy(llm, reference, questions, max_tokens)),
        _guarded("latency", lambda: latency_part(llm, prompt_len, max_tokens)),
    ]
    if any(k.fast_only for k in llm.driver.kernels) or llm.driver.fused_backends:
        parts.append(
            _guarded(
                "fast plan",
                lambda: fast_plan_part(llm, questions, max_tokens, prompt_len, tolerance),
            )
        )
    return {
        "device": llm.driver.label,
        "model": str(llm.model_dir),
        "machine": machine(),
        "tolerance": tolerance,
        "passed": all(p.passed for p in parts),
        "parts": [attrs.asdict(p) for p in parts],
    }


def markdown_acceptance(report: dict) -> str:
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"# rlt-hal acceptance on {report['device']}: {verdict}\n",
        f"model `{report['model']}`\n",
        "| part | result | summary |",
        "|---|---|---|",
    ]
    for p in report["parts"]:
        lines.append(f"| {p['name']} | {'pass' if p['passed'] else 'FAIL'} | {p['summary']} |")
    for p in report["parts"]:
        if "table" in p["details"]:
            lines += ["", f"## {p['name']}", "", p["details"]["table"]]
    return "\n".join(lines)
