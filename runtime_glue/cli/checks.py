"""``rlt-hal parity | acceptance | eval``: is a device, a backend or a configuration correct?"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs

from runtime_glue.cli.prompts import add_prompt_args, prompt_of_args
from runtime_glue.engine.args import EngineArgs


def _checked(args: argparse.Namespace) -> EngineArgs:
    """The engine options of a check, its banner printed if it runs a toy checkpoint. Checks
    compare HF-exact runs unless ``--deterministic`` is given (a device's own default mode
    would compare two different contracts)."""
    options = EngineArgs.from_cli_args(args, deterministic=bool(args.deterministic))
    if options.banner():
        print(options.banner(), file=sys.stderr)
    return options


def _engine(options: EngineArgs):
    """The engine of ``options`` (imported here: parsing the command line never loads torch)."""
    from runtime_glue.engine.llm import build_llm

    return build_llm(options)


def cmd_parity(args: argparse.Namespace) -> int:
    from runtime_glue.checks.parity import compare

    prompt = prompt_of_args(args)  # checked before anything loads
    options = _checked(args)
    # Side A always prefills whole; side B is side A with the --against* changes and the
    # chunk size given.
    a = _engine(attrs.evolve(options, prefill_chunk_size=None))
    b = _engine(
        attrs.evolve(
            options,
            device=args.against or options.device,
            attention_backend=args.against_backend,
        )
    )

    def label(llm, chunk):
        mode = f"chunk={chunk}" if chunk else "full-prefill"
        return f"{llm.driver.label}/{llm.model.backend.name}/{mode}"

    report = compare(
        a,
        b,
        a.encode(prompt),
        args.max_tokens,
        label(a, None),
        label(b, args.prefill_chunk_size),
    )
    print(json.dumps(report.to_json()) if args.json else report.describe())
    return 0 if report.equal else 1


def cmd_acceptance(args: argparse.Namespace) -> int:
    from runtime_glue.cli.acceptance import acceptance, markdown_acceptance

    options = EngineArgs.from_cli_args(args)
    if options.banner():
        print(options.banner(), file=sys.stderr)
    report = acceptance(
        options.model_dir(),
        options.device,  # None: $VLLM_RLT_DEVICE, else auto
        questions_path=args.questions,
        limit=args.limit,
        tolerance=args.tolerance,
        max_tokens=args.max_tokens,
        prompt_len=args.prompt_len,
    )
    table = markdown_acceptance(report)
    _write_reports(args, report, table)
    print(table)
    return 0 if report["passed"] else 1


def cmd_eval(args: argparse.Namespace) -> int:
    from runtime_glue.checks.evaluation import (
        LLMSide,
        ReferenceSide,
        evaluate,
        load_questions,
        markdown_evaluation,
        sample_questions,
    )

    if args.perplexity:
        return cmd_perplexity(args)
    options = _checked(args)

    def side(device):
        return _engine(attrs.evolve(options, device=device))

    a = side(options.device)
    b: LLMSide | ReferenceSide
    if args.against == "reference":
        from runtime_glue.checks.reference import OuroReference

        dev = a.driver.device.torch_device
        from runtime_glue.ouro.quantize import dequantized

        ref = OuroReference(a.config).load(a.model_dir, dequantized(a.weights))
        b = ReferenceSide(ref.to(dev), dev)
    else:
        b = LLMSide(side(args.against))
    questions = load_questions(args.questions or sample_questions())[: args.limit]
    report = evaluate(a.tokenizer, questions, LLMSide(a), b, args.template, args.max_tokens)
    table = markdown_evaluation(report)
    _write_reports(args, report, table)
    print(table)
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    import tempfile

    from runtime_glue.checks.perplexity import (
        markdown_perplexity,
        perplexity,
        write_initial_checkpoint,
    )

    options = _checked(args)
    llm = _engine(options)
    with tempfile.TemporaryDirectory(prefix="rlt-hal-init-") as tmp:
        baseline = None
        if args.random_baseline:
            write_initial_checkpoint(llm.model_dir, Path(tmp))
            baseline = _engine(attrs.evolve(options, model=tmp))
        report = perplexity(
            llm, args.seq_len, args.perplexity_tokens, args.adaptive_tokens, baseline
        )
    table = markdown_perplexity(report)
    _write_reports(args, report, table)
    print(table)
    return 0


def _write_reports(args: argparse.Namespace, report: dict, table: str) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


def _add_report_args(p) -> None:
    p.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    p.add_argument("--markdown", metavar="OUT", help="also write the table to OUT")


def _add_parity(sub) -> None:
    p = sub.add_parser(
        "parity",
        help="run one request two ways and locate the first difference (exit 1 when they differ)",
    )
    # The engine options describe side A (which always prefills whole) and, but for the
    # --against* options, side B; --prefill-chunk-size applies to side B only. Both sides are
    # HF-exact unless --deterministic is given.
    EngineArgs.add_cli_args(p)
    p.add_argument("--against", help="side B's device (default: the same device as A)")
    p.add_argument("--against-backend", help="side B's attention backend")
    add_prompt_args(p, default="The quick brown fox jumps over the lazy dog")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens each side generates")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_parity)


def _add_acceptance(sub) -> None:
    p = sub.add_parser(
        "acceptance",
        help="is this device correct for Ouro? reference parity, cross-device, chunking, "
        "accuracy, latency (exit 1 when a part fails)",
    )
    EngineArgs.add_cli_args(p, fields=("model", "preset", "device"))
    p.add_argument("--questions", help="JSONL question set (default: the one rlt-hal ships)")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--tolerance", type=float, default=0.5, help="cross-device |logit| tolerance")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="the latency part's prompt")
    _add_report_args(p)
    p.set_defaults(func=cmd_acceptance)


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval", help="exact-match accuracy of two configurations on a question set, and agreement"
    )
    # Side A: rlt-hal with these options (HF-exact unless --deterministic).
    EngineArgs.add_cli_args(
        p, fields=("model", "preset", "device", "deterministic", "kv_sharing")
    )  # --kv-sharing last: --perplexity also measures the mode against full KV
    p.add_argument(
        "--against",
        default="reference",
        help="side B: 'reference' (the HF-module reference on side A's device) or a device",
    )
    p.add_argument("--questions", help="JSONL, one {id, question, answers} a line")
    p.add_argument(
        "--template", default="Question: {question}\nAnswer:", help="the prompt of a question"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per answer")
    p.add_argument("--limit", type=int, help="only the first N questions")
    _add_report_args(p)
    ppl = p.add_argument_group(
        "--perplexity: held-out perplexity and accuracy per exit mode, through the runtime"
    )
    ppl.add_argument("--perplexity", action="store_true", help="this instead of the questions")
    ppl.add_argument("--seq-len", type=int, help="window length (default: the training's)")
    ppl.add_argument("--perplexity-tokens", type=int, help="held-out positions scored")
    ppl.add_argument(
        "--adaptive-tokens",
        type=int,
        default=2048,
        help="teacher-forced decode positions for adaptive depth (0: skip)",
    )
    ppl.add_argument(
        "--random-baseline",
        action="store_true",
        help="also score the same model with its initial random weights",
    )
    p.set_defaults(func=cmd_eval)


def add_parsers(sub) -> None:
    _add_parity(sub)
    _add_acceptance(sub)
    _add_eval(sub)
