"""The ``rlt-hal`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from runtime_glue.cli.parser import Parser
from runtime_glue.cli.prompts import add_prompt_args, prompt_of_args
from runtime_glue.engine.args import EngineArgs
from runtime_glue.ouro.presets import PRESETS
from runtime_glue.server.args import ServerArgs

DESCRIPTION = (
    "Serve and check ByteDance's Ouro looped language models on an Ascend NPU, a CUDA GPU or "
    "the CPU. Each command's options: rlt-hal COMMAND --help."
)


def announced_llm(args: argparse.Namespace, progress: bool = True):
    """The engine of a command's ``EngineArgs`` options, announced on standard error."""
    from runtime_glue.engine.llm import build_llm

    return build_llm(EngineArgs.from_cli_args(args), progress=progress, announce=True)


def cmd_drivers(args: argparse.Namespace) -> int:
    from hal.registry import default_registry

    rows = [
        {
            "name": spec.name,
            "available": probe.available,
            "reason": probe.reason,
            "description": spec.description,
        }
        for spec, probe in default_registry().probe_all()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "available" if r["available"] else "unavailable"
        state += f": {r['reason']}" if r["reason"] else ""
        print(f"{r['name']:<8} {state}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The execution plan for a model here, with the measurements behind it: its start-up
    lines are the command's output (standard output, once), then its notes and measurements."""
    from runtime_glue.engine.announce import announce_llm
    from runtime_glue.engine.llm import build_llm
    from runtime_glue.ouro.resolve import record_note

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.banner():
        print(engine_args.banner(), file=sys.stderr)
    llm = build_llm(engine_args)
    plan = llm.plan
    if args.json:
        print(json.dumps({"device": llm.driver.label, **plan.to_json()}, indent=2))
        return 0
    announce_llm(llm, file=sys.stdout)
    shown = record_note(plan)
    for note in plan.notes:
        if note != shown:
            print(f"  {note}")
    for a in plan.admissions:  # --mode fast: each fused kernel's check on this device
        print(f"  {a.op} {a.kernel}: {'admitted' if a.admitted else 'refused'}, {a.why}")
    if plan.measurements:
        print("\n| op | rows of | kernel | call rows | ms | chosen |\n|---|---|---|---|---|---|")
        for m in plan.measurements:
            chosen = "yes" if plan.choice(m.kind, m.op).kernel == m.kernel else ""
            print(
                f"| {m.op} | {m.kind} | {m.kernel} | {m.rows} | {m.seconds * 1e3:.3f} | {chosen} |"
            )
    return 0


def refuse_non_empty(dst: str | Path, command: str, force: bool) -> None:
    """A checkpoint is written into a new or empty directory, or where ``--force`` says so:
    never silently over another checkpoint or beside other files."""
    dst = Path(dst)
    if force or not dst.exists():
        return
    if not dst.is_dir():
        raise ValueError(f"{dst}: exists and is not a directory")
    present = sorted(p.name for p in dst.iterdir())
    if present:
        shown = ", ".join(present[:3]) + (
            f" and {len(present) - 3} more" if len(present) > 3 else ""
        )
        raise ValueError(
            f"{dst}: exists and is not empty ({shown}); rlt-hal {command} writes a new "
            "directory (--force writes into it, replacing files of the same names)"
        )


def cmd_toy_checkpoint(args: argparse.Namespace) -> int:
    from runtime_glue.ouro.toy import preset_config, write_checkpoint

    refuse_non_empty(args.dir, "toy-checkpoint", args.force)
    if args.preset == "trained":
        if args.thinking:
            raise ValueError(
                "--thinking writes random weights in the Thinking layout; the trained preset "
                "learned no reasoning format"
            )
        return _trained_checkpoint(args)
    cfg = preset_config(args.preset, total_ut_steps=args.loops)
    path = write_checkpoint(
        args.dir,
        cfg,
        seed=args.seed,
        shards=args.shards,
        gate_bias=args.gate_bias,
        thinking=args.thinking,
    )
    layout = " in the Thinking layout" if args.thinking else ""
    print(f"wrote a random {args.preset} Ouro checkpoint{layout} to {path}")
    return 0


def _trained_checkpoint(args: argparse.Namespace) -> int:
    """The trained preset: trained once into the cache (by its recipe's hash), then copied."""
    import shutil

    from runtime_glue.ouro.toy import cached_checkpoint, training_summary

    fixed = {
        "--seed": (args.seed, 0),
        "--loops": (args.loops, 4),
        "--gate-bias": (args.gate_bias, 0.0),
    }
    for flag, (value, default) in fixed.items():
        if value != default:
            raise ValueError(f"{flag} does not apply to --preset trained (its recipe fixes it)")
    if args.shards != 1:
        raise ValueError("--shards must be 1 with --preset trained")
    cached = cached_checkpoint("trained")
    shutil.copytree(cached, args.dir, dirs_exist_ok=True)
    print(f"wrote the trained Ouro checkpoint to {args.dir} (trained once, cached at {cached})")
    print(training_summary(args.dir))
    return 0


# llm-compressor's W8A16 preset: int8 with a scale per group; per channel on request. W8A8
# dynamic: int8 per channel, the activations quantized per token when it runs.
QUANTIZE_SCHEMES = {
    "w8a16": "int8g",
    "w8a16-channel": "int8",
    "w4a16": "int4",
    "w8a8-dynamic": "int8",
    "w8a16-asym": "int8z",
}
QUANTIZE_FORMATS = ("compressed-tensors", "msmodelslim")
MSMODELSLIM_TYPES = {
    "w8a16": "W8A16",
    "w8a16-channel": "W8A16",
    "w8a16-asym": "W8A16",
    "w8a8-dynamic": "W8A8_DYNAMIC",
}


def cmd_quantize(args: argparse.Namespace) -> int:
    """A bf16 checkpoint quantized by rlt-hal, written in compressed-tensors' format or
    msModelSlim's."""
    from hal.quant import describe
    from hal.registry import default_registry
    from runtime_glue.ouro import compressed_write, msmodelslim
    from runtime_glue.ouro.checkpoint import load_weights
    from runtime_glue.ouro.config import OuroConfig
    from runtime_glue.ouro.quantize import check_quantization, quantize_weights

    src, dst = Path(args.src), Path(args.dst)
    refuse_non_empty(dst, "quantize", args.force)
    cfg = OuroConfig.from_dir(src)
    scheme = QUANTIZE_SCHEMES[args.scheme]
    if args.format == "msmodelslim" and (args.scheme not in MSMODELSLIM_TYPES or args.lm_head):
        raise ValueError(
            f"--format msmodelslim writes {', '.join(MSMODELSLIM_TYPES)} with lm_head in bf16 "
            "(what vllm-ascend loads); use --format compressed-tensors for "
            + ("--lm-head" if args.lm_head else f"--scheme {args.scheme}")
        )
    why = check_quantization(cfg, scheme, args.group_size)
    if why is not None:
        raise ValueError(why)
    device = default_registry().create("cpu").device
    weights = quantize_weights(
        load_weights(src, cfg, device), cfg, scheme, args.group_size, args.lm_head, device
    )
    token = args.scheme == "w8a8-dynamic"
    if args.format == "msmodelslim":
        msmodelslim.write(src, dst, weights, MSMODELSLIM_TYPES[args.scheme], args.group_size)
    else:
        compressed_write.write(src, dst, weights, scheme, args.group_size, activations=token)
    what = describe(scheme, args.group_size) + (" (activations per token)" if token else "")
    print(f"wrote {what} weights in the {args.format} format to {dst}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime_glue.engine.sampling import SamplingParams

    prompt = prompt_of_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = announced_llm(args, progress=not args.json)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "device": llm.driver.label,
                    "attention_backend": llm.model.backend.name,
                    "prompt_token_ids": list(out.prompt_token_ids),
                    "token_ids": list(out.token_ids),
                    "exit_steps": list(out.exit_steps),
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                    "elapsed_s": round(elapsed, 4),
                    "tokens_per_s": round(len(out.token_ids) / elapsed, 3) if elapsed else None,
                }
            )
        )
    elif args.show_depth:
        print(show_depth(llm.tokenizer, out.token_ids, out.exit_steps))
    else:
        print(out.text)
    return 0


def show_depth(tokenizer, token_ids, exit_steps) -> str:
    """The text with, after each token, the loop its logits came from, 0-based as the API's
    ``exit_steps`` and ``--exit-at-step`` count: ``Hello[1] world[3]``."""
    pieces = [
        f"{tokenizer.decode([t], skip_special_tokens=True)}[{step}]"
        for t, step in zip(token_ids, exit_steps, strict=True)
    ]
    return "".join(pieces)


def cmd_run(args: argparse.Namespace) -> int:
    """The main job without a server: generate from the default (or given) checkpoint."""
    args.prompt_ids, args.temperature, args.seed, args.json = None, 0.0, None, False
    args.show_depth = False
    args.ignore_eos = True
    print(f"prompt: {args.prompt!r}")
    return cmd_generate(args)


def cmd_serve(args: argparse.Namespace) -> int:
    engine, options = EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args)
    if options.replicas is None:
        from runtime_glue.server import app

        return app.run(engine, options)
    try:
        from runtime_glue.server import replicas
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "ray":
            raise
        raise RuntimeError(
            "--replicas runs the server on Ray Serve, which is not installed here: "
            "pip install 'rlt-hal[ray]' (see docs/scale-out.md)"
        ) from None
    return replicas.run(engine, options)


def _add_drivers(sub) -> None:
    p = sub.add_parser("drivers", help="list drivers and whether each can run here")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_drivers)


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="the execution plan (mode, kernel per op) for a model here, and why"
    )
    EngineArgs.add_cli_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def _add_toy_checkpoint(sub) -> None:
    p = sub.add_parser(
        "toy-checkpoint",
        help="write a small Ouro checkpoint: random weights, or --preset trained (trained here)",
    )
    p.add_argument("dir", help="the directory to write (created if missing)")
    p.add_argument(
        "--preset",
        default="tiny",
        choices=list(PRESETS),
        help="the model's shape; 'trained' is trained here once (minutes), then copied",
    )
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--loops", type=int, default=4, help="loops per token (total_ut_steps)")
    p.add_argument(
        "--shards", type=int, default=1, help="safetensors files (more than 1: with an index)"
    )
    p.add_argument(
        "--gate-bias",
        type=float,
        default=0.0,
        help="the exit gate's bias: higher, earlier exits (rlt-hal bench adaptive)",
    )
    p.add_argument(
        "--thinking",
        action="store_true",
        help="the Thinking variants' layout: <think> and </think> tokens, and a chat template "
        "whose enable_thinking (chat_template_kwargs) opens the reasoning block",
    )
    _add_force(p)
    p.set_defaults(func=cmd_toy_checkpoint)


def _add_force(p) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a directory that is not empty (files of the same names are replaced)",
    )


def _add_quantize(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="quantize a bf16 checkpoint and write it in compressed-tensors' format (as "
        "llm-compressor does; vLLM and rlt-hal load it)",
    )
    p.add_argument("src", help="the bf16 checkpoint's directory")
    p.add_argument("dst", help="the directory to write (new, or empty)")
    p.add_argument(
        "--scheme",
        required=True,
        choices=list(QUANTIZE_SCHEMES),
        help="w8a16: int8 weights, one scale per group (llm-compressor's W8A16); "
        "w8a16-channel: int8, one scale per output channel; w4a16: int4, one per group; "
        "w8a16-asym: int8, a scale and a zero point per group (asymmetric, int8z); "
        "w8a8-dynamic: int8 per channel, run with the activations quantized per token "
        "(llm-compressor's W8A8, msModelSlim's W8A8_DYNAMIC)",
    )
    p.add_argument(
        "--format",
        choices=QUANTIZE_FORMATS,
        default="compressed-tensors",
        help="compressed-tensors (llm-compressor's, vLLM's) or msmodelslim (the layout of "
        "msModelSlim's quant_model_description.json, vllm-ascend's --quantization ascend)",
    )
    p.add_argument("--group-size", type=int, default=128, help="inputs per scale: 32, 64 or 128")
    p.add_argument("--lm-head", action="store_true", help="quantize lm_head too")
    _add_force(p)
    p.set_defaults(func=cmd_quantize)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate for one prompt")
    EngineArgs.add_cli_args(p)
    add_prompt_args(p, required=True)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, help="the sampling seed (default: unseeded)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument(
        "--json", action="store_true", help="print the tokens, exit loops, text and timing as JSON"
    )
    p.add_argument(
        "--show-depth",
        action="store_true",
        help="print each token followed by [k]: the loop its logits came from (0-based, as "
        "--exit-at-step and the API's exit_steps count)",
    )
    p.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(p)
    ServerArgs.add_cli_args(p)
    p.set_defaults(func=cmd_serve)


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="generate from the embedded default checkpoint")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", default="The quick brown fox", help="the prompt's text")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    p.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    from runtime_glue.bench import cli as bench_cli
    from runtime_glue.cli import checks as checks_cli

    parser = Parser(prog="rlt-hal", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_drivers(sub)
    _add_toy_checkpoint(sub)
    _add_quantize(sub)
    _add_generate(sub)
    _add_plan(sub)
    _add_serve(sub)
    checks_cli.add_parsers(sub)
    bench_cli.add_parsers(sub)
    _add_run(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"rlt-hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
