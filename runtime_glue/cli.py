"""The ``rlt-hal`` command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from runtime_glue.server import DEFAULT_MAX_REQUEST_BYTES
from runtime_glue.toy import PRESETS

RANDOM_BANNER = (
    "NOTE: no --model given; using the embedded toy checkpoint with RANDOM weights. "
    "Its output is random text. Pass --model /path/to/Ouro-1.4B for a real model."
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Ouro checkpoint directory (default: embedded random toy)")
    p.add_argument(
        "--device", help="cpu, cuda[:N], npu[:N] or auto (default: $VLLM_RLT_DEVICE or auto)"
    )
    p.add_argument("--attention-backend", help="e.g. cpu_eager, cuda_sdpa, ascend_eager")
    p.add_argument(
        "--linear",
        help="one projection kernel for every projection: torch (F.linear, HF-exact) or one the "
        "driver offers, e.g. avx2 or avx512bf16 on cpu (not HF-exact). Default: torch in "
        "HF-exact mode; in deterministic mode the fastest that keeps the mode, measured here "
        "(rlt-hal plan shows the choice)",
    )
    p.add_argument("--block-size", type=int, default=128)
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int)
    pool.add_argument("--kv-cache-memory", type=int, metavar="BYTES")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prefill-chunk-size", type=int)
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        help="bit-identical results whatever the chunk size or batch mix; --no-deterministic "
        "keeps HF's own bits for a lone request (default: the backend's choice, on for cpu)",
    )
    p.add_argument(
        "--exit-threshold",
        type=float,
        help="default exit threshold of Ouro's gate for requests that choose none (in (0, 1]; "
        "default: the checkpoint's early_exit_threshold)",
    )
    p.add_argument(
        "--exit-at-step", type=int, help="default loop to read logits from (0 .. loops - 1)"
    )
    p.add_argument(
        "--adaptive-depth",
        action="store_true",
        help="decode rows that reach their exit threshold skip their remaining loops (an "
        "approximation: docs/benchmarks.md)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="share the KV of prompt blocks already computed (default: on in deterministic "
        "mode, where a hit gives exactly the bits of recomputing; off in HF-exact mode, where "
        "the bits may differ within the engine's tolerance)",
    )


def build_llm(args: argparse.Namespace, progress: bool = True):
    from runtime_glue.llm import LLM

    if args.model is None:
        print(RANDOM_BANNER, file=sys.stderr)
    llm = LLM(
        model=args.model,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        progress=progress,
        deterministic=args.deterministic,
        linear=args.linear,
        exit_at_step=args.exit_at_step,
        exit_threshold=args.exit_threshold,
        adaptive_depth=args.adaptive_depth,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    caching = "on" if llm.engine.config.enable_prefix_caching else "off"
    print(f"{llm.driver.label}: {llm.plan.describe()}; prefix caching {caching}", file=sys.stderr)
    print(llm.kv_summary, file=sys.stderr)
    return llm


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
    """The execution plan for a model here, with the measurements behind it."""
    llm = build_llm(args, progress=False)
    plan = llm.plan
    if args.json:
        print(json.dumps({"device": llm.driver.label, **plan.to_json()}, indent=2))
        return 0
    print(plan.describe())
    for note in plan.notes:
        print(f"  {note}")
    if plan.measurements:
        print("\n| op | rows of | kernel | call rows | ms | chosen |\n|---|---|---|---|---|---|")
        for m in plan.measurements:
            chosen = "yes" if plan.choice(m.kind, m.op).kernel == m.kernel else ""
            print(
                f"| {m.op} | {m.kind} | {m.kernel} | {m.rows} | {m.seconds * 1e3:.3f} | {chosen} |"
            )
    return 0


def cmd_toy_checkpoint(args: argparse.Namespace) -> int:
    from runtime_glue.toy import preset_config, write_checkpoint

    cfg = preset_config(args.preset, total_ut_steps=args.loops)
    path = write_checkpoint(
        args.dir, cfg, seed=args.seed, shards=args.shards, gate_bias=args.gate_bias
    )
    print(f"wrote a random {args.preset} Ouro checkpoint to {path}")
    return 0


def prompt_of_args(args: argparse.Namespace) -> list[int] | str:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime_glue.sampling import SamplingParams

    prompt = prompt_of_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    llm = build_llm(args, progress=not args.json)
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
    """The text with each token's depth (loops run, 1-based) after it: ``Hello[2] world[4]``."""
    pieces = [
        f"{tokenizer.decode([t], skip_special_tokens=True)}[{step + 1}]"
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


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or (str(args.model) if args.model else "rlt-hal-toy-random")


def serve_replicas(args: argparse.Namespace) -> int:
    try:
        from runtime_glue.server import replicas
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "ray":
            raise
        raise RuntimeError(
            "--replicas runs the server on Ray Serve, which is not installed here: "
            "pip install 'rlt-hal[ray]' (see docs/scale-out.md)"
        ) from None
    return replicas.run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return serve_replicas(args)
    given = [
        flag
        for flag in ("--ray-address", "--ray-metrics-export-port", "--cpus-per-replica")
        if getattr(args, flag[2:].replace("-", "_")) is not None
    ]
    if given:
        raise ValueError(f"{', '.join(given)}: Ray options, for serve --replicas N only")
    import uvicorn

    from runtime_glue.server.app import Server, build_app

    llm = build_llm(args)
    name = served_model_name(args)
    server = Server(
        llm,
        name,
        api_key=args.api_key,
        default_max_tokens=args.default_max_tokens,
        max_request_bytes=args.max_request_bytes,
    )
    print(
        f"serving {name!r} on http://{args.host}:{args.port}/v1 ({llm.driver.label})",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        build_app(server),
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal to the handler that was
    # installed before it; a no-op one there turns a graceful shutdown into exit status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    return 0


def _add_drivers(sub) -> None:
    p = sub.add_parser("drivers", help="list drivers and whether each can run here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_drivers)


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="the execution plan (mode, kernel per op) for a model here, and why"
    )
    _add_engine_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def _add_toy_checkpoint(sub) -> None:
    p = sub.add_parser("toy-checkpoint", help="write a small random Ouro checkpoint")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loops", type=int, default=4, help="total_ut_steps")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument(
        "--gate-bias",
        type=float,
        default=0.0,
        help="the exit gate's bias: higher, earlier exits (rlt-hal bench adaptive)",
    )
    p.set_defaults(func=cmd_toy_checkpoint)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate for one prompt")
    _add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--show-depth", action="store_true", help="print each token with the loops it ran"
    )
    p.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=16,
        help="max_tokens when a request gives none (OpenAI's default is 16)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="request bodies larger than this are answered with 413 before they are read "
        f"(default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM",
    )
    ray = p.add_argument_group(
        "replicas on Ray Serve (pip install 'rlt-hal[ray]'; see docs/scale-out.md)"
    )
    ray.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="serve N engines, one per device, behind one endpoint through Ray Serve",
    )
    ray.add_argument(
        "--ray-address",
        metavar="auto|ADDR",
        help="join this Ray cluster (auto: the one `ray start` began here); default: start one",
    )
    ray.add_argument(
        "--ray-metrics-export-port",
        type=int,
        metavar="PORT",
        help="where the Ray cluster this command starts serves every replica's metrics to "
        "Prometheus (a joined cluster: ray start --metrics-export-port)",
    )
    ray.add_argument(
        "--cpus-per-replica",
        type=float,
        help="CPU cores Ray reserves for each replica, its torch threads on --device cpu "
        "(default 1)",
    )
    p.set_defaults(func=cmd_serve)


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="generate from the embedded default checkpoint")
    _add_engine_args(p)
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    from runtime_glue import checks_cli
    from runtime_glue.bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="rlt-hal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_drivers(sub)
    _add_toy_checkpoint(sub)
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
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"rlt-hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
