"""Quality of weight-only quantization (``--quantization``) on one checkpoint, one row per
scheme: held-out perplexity per loop (``rlt-hal eval --perplexity``'s windows and scorer),
greedy agreement with bf16 (continuations of held-out passages, the checkpoint's exit
defaults), the exit gate's depth distribution at its threshold, and exact speculation's
acceptance (drafts from loop ``--draft-loops``).

    python benchmarks/quant_quality.py --preset trained --json OUT.json
    python benchmarks/quant_quality.py --model DIR --json OUT.json --tokens 16384

Quality claims need learned weights: run it on a trained checkpoint, and name it.
"""

from __future__ import annotations

import argparse
import json
import time

from runtime_glue.bench.engine_bench import machine
from runtime_glue.checks.perplexity import heldout_windows, perplexity, training_record
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro import corpus

SCHEMES = {  # label -> LLM options
    "bf16": {},
    "int8": dict(quantization="int8"),
    "int4 g32": dict(quantization="int4", quantization_group_size=32),
    "int4 g64": dict(quantization="int4", quantization_group_size=64),
    "int4 g128": dict(quantization="int4", quantization_group_size=128),
    # The W8A8 / W4A8 kernels named: at a small model's shapes another kernel may time faster.
    "int8 + int8 activations": dict(
        quantization="int8", quantize_activations=True, linear="int8-a8-avx2"
    ),
    "int4 g32 + int8 activations": dict(
        quantization="int4",
        quantization_group_size=32,
        quantize_activations=True,
        linear="int4-a8-avx2",
    ),
}


def prompts_of(llm: LLM, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of ``count`` held-out windows."""
    recipe = (training_record(llm.model_dir) or {}).get("recipe", {})
    sources = recipe.get("sources", corpus.SOURCES)
    held, _ = heldout_windows(llm.tokenizer, sources, 128, 128 * count)
    return [w[:length].tolist() for w in held[:count]]


def agreement(tokens: list[list[int]], base: list[list[int]]) -> dict:
    """Share of bf16's tokens reproduced before the first difference, and position by
    position."""
    prefix = same = total = 0
    for got, want in zip(tokens, base, strict=True):
        first = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want)
        )
        prefix += first
        same += sum(a == b for a, b in zip(got, want, strict=True))
        total += len(want)
    return {"prefix": prefix / total, "positionwise": same / total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--preset", default="trained")
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", type=int, default=16384, help="held-out positions scored")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--draft-loops", type=int, default=1)
    p.add_argument("--only", nargs="+", choices=list(SCHEMES), help="these rows (and bf16)")
    args = p.parse_args()
    report: dict = {"machine": machine(), "schemes": {}}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    base_tokens = None
    for label, options in SCHEMES.items():
        if args.only and label != "bf16" and label not in args.only:
            continue
        start = time.perf_counter()
        llm = LLM(args.model, preset=args.preset, **options)
        ppl = perplexity(llm, max_tokens=args.tokens, adaptive_tokens=0)
        prompts = prompts_of(llm, args.prompts, 24)
        tokens = [list(o.token_ids) for o in llm.generate(prompts, params)]
        base_tokens = base_tokens or tokens
        spec = llm.with_speculation(args.draft_loops, tokens=4)
        spec_tokens = [list(o.token_ids) for o in spec.generate(prompts, params)]
        stats = spec.engine.stats
        threshold = next(m for name, m in ppl["modes"].items() if name.startswith("threshold"))
        report["checkpoint"] = str(llm.model_dir)
        projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        kernels = sorted(
            {
                llm.plan.choice(kind, op).kernel
                for kind in ("prompt", "generated")
                for op in projections
            }
        )
        report["schemes"][label] = {
            "plan": llm.plan.describe(),
            "projection_kernels": kernels,
            "perplexity_per_loop": [
                ppl["modes"][f"loop {t}"]["perplexity"] for t in range(llm.config.total_ut_steps)
            ],
            "threshold": {
                k: threshold[k] for k in ("perplexity", "exit_loop_histogram", "mean_exit_loop")
            },
            "greedy_agreement_with_bf16": agreement(tokens, base_tokens),
            "speculation": {
                "acceptance": stats["spec_accepted"] / max(stats["spec_drafted"], 1),
                "equals_plain_decoding": spec_tokens == tokens,
            },
            "seconds": time.perf_counter() - start,
        }
        print(label, json.dumps(report["schemes"][label]), flush=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(markdown(report))


def markdown(report: dict) -> str:
    base = report["schemes"]["bf16"]["perplexity_per_loop"][-1]
    lines = [
        "| weights (kernels) | perplexity per loop (0..3) | last loop vs bf16 | threshold: perplexity, "
        "mean exit loop, loops 0..3 | greedy = bf16 (prefix / positionwise) | speculation "
        "acceptance (exact) |",
        "|---|---|--:|---|---|---|",
    ]
    for label, r in report["schemes"].items():
        loops = " / ".join(f"{p:.2f}" for p in r["perplexity_per_loop"])
        hist = " / ".join(f"{h:.0%}" for h in r["threshold"]["exit_loop_histogram"])
        agree = r["greedy_agreement_with_bf16"]
        spec = r["speculation"]
        exact = "yes" if spec["equals_plain_decoding"] else "NO"
        lines.append(
            f"| {label} ({', '.join(r['projection_kernels'])}) | {loops} | {r['perplexity_per_loop'][-1] / base - 1:+.2%} | "
            f"{r['threshold']['perplexity']:.2f}, {r['threshold']['mean_exit_loop']:.2f}, "
            f"{hist} | {agree['prefix']:.1%} / {agree['positionwise']:.1%} | "
            f"{spec['acceptance']:.1%} ({exact}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
