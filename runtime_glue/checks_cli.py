"""``rlt-hal parity | acceptance | eval``: is a device, a backend or a configuration correct?"""

from __future__ import annotations

import argparse
import json
import sys

from runtime_glue.cli import RANDOM_BANNER, prompt_of_args


def cmd_parity(args: argparse.Namespace) -> int:
    from runtime_glue.llm import LLM
    from runtime_glue.parity import compare

    def side(device, backend, chunk):
        return LLM(
            model=args.model,
            device=device,
            attention_backend=backend,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            prefill_chunk_size=chunk,
            deterministic=args.deterministic,
        )

    if args.model is None:
        print(RANDOM_BANNER, file=sys.stderr)
    a = side(args.device, args.attention_backend, None)
    b = side(args.against or args.device, args.against_backend, args.prefill_chunk_size)

    def label(llm, chunk):
        mode = f"chunk={chunk}" if chunk else "full-prefill"
        return f"{llm.driver.label}/{llm.model.backend.name}/{mode}"

    report = compare(
        a,
        b,
        a.encode(prompt_of_args(args)),
        args.max_tokens,
        label(a, None),
        label(b, args.prefill_chunk_size),
    )
    print(json.dumps(report.to_json()) if args.json else report.describe())
    return 0 if report.equal else 1


def cmd_acceptance(args: argparse.Namespace) -> int:
    from runtime_glue.acceptance import acceptance, markdown_acceptance

    report = acceptance(
        args.model,
        args.device,
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
    from runtime_glue.evaluation import (
        LLMSide,
        ReferenceSide,
        evaluate,
        load_questions,
        markdown_evaluation,
        sample_questions,
    )
    from runtime_glue.llm import LLM

    def side(device):
        return LLM(args.model, device=device, deterministic=args.deterministic)

    a = side(args.device)
    b: LLMSide | ReferenceSide
    if args.against == "reference":
        from runtime_glue.reference import OuroReference

        dev = a.driver.device.torch_device
        b = ReferenceSide(OuroReference(a.config).load(a.model_dir).to(dev), dev)
    else:
        b = LLMSide(side(args.against))
    questions = load_questions(args.questions or sample_questions())[: args.limit]
    report = evaluate(a.tokenizer, questions, LLMSide(a), b, args.template, args.max_tokens)
    table = markdown_evaluation(report)
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


def _add_parity(sub) -> None:
    p = sub.add_parser(
        "parity",
        help="run one request two ways and locate the first difference (exit 1 when they differ)",
    )
    p.add_argument("--model")
    p.add_argument("--device", help="side A (full prefill)")
    p.add_argument("--against", help="side B (default: the same device as A)")
    p.add_argument("--attention-backend", help="side A's backend")
    p.add_argument("--against-backend", help="side B's backend")
    p.add_argument("--prefill-chunk-size", type=int, help="side B prefills in chunks of N")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog")
    src.add_argument("--prompt-ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="both sides in deterministic mode (default: both HF-exact, whatever the device)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_parity)


def _add_acceptance(sub) -> None:
    p = sub.add_parser(
        "acceptance",
        help="is this device correct for Ouro? reference parity, cross-device, chunking, "
        "accuracy, latency (exit 1 when a part fails)",
    )
    p.add_argument("--model", required=True, help="an Ouro checkpoint directory")
    p.add_argument("--device", required=True, help="e.g. npu, npu:1, cuda, cpu")
    p.add_argument("--questions", help="JSONL question set (default: the one rlt-hal ships)")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--tolerance", type=float, default=0.5, help="cross-device |logit| tolerance")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64, help="the latency part's prompt")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--markdown", metavar="OUT")
    p.set_defaults(func=cmd_acceptance)


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval", help="exact-match accuracy of two configurations on a question set, and agreement"
    )
    p.add_argument("--model", help="Ouro checkpoint directory (default: embedded random toy)")
    p.add_argument("--device", help="side A: rlt-hal on this device (default: auto)")
    p.add_argument(
        "--against",
        default="reference",
        help="side B: 'reference' (the HF-module reference on side A's device) or a device",
    )
    p.add_argument("--questions", help="JSONL, one {id, question, answers} a line")
    p.add_argument("--template", default="Question: {question}\nAnswer:")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--limit", type=int)
    p.add_argument("--deterministic", action="store_true", help="rlt-hal sides in that mode")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--markdown", metavar="OUT")
    p.set_defaults(func=cmd_eval)


def add_parsers(sub) -> None:
    _add_parity(sub)
    _add_acceptance(sub)
    _add_eval(sub)
