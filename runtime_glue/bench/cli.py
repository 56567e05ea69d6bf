"""``rlt-hal bench KIND``: each benchmark prints the plan it ran and a markdown table, and with
``--json OUT`` writes its report."""

from __future__ import annotations

import argparse
import json
import sys

import attrs

from runtime_glue.engine.args import EngineArgs

# A benchmark sizes the pool and the step for its own load, and repeats its prompts (each run
# must compute them): these engine options are the benchmark's, not the user's.
SET_BY_BENCH = ("num_blocks", "kv_cache_memory", "max_num_batched_tokens", "enable_prefix_caching")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _model_args(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(
        p, fields=[f.name for f in attrs.fields(EngineArgs) if f.name not in SET_BY_BENCH]
    )
    p.add_argument("--json", metavar="OUT", help="also write the JSON report to OUT")


def _load_args(p: argparse.ArgumentParser, output_len: int = 16) -> None:
    """A batch of prompts run several times, with c=1 and c=N levels."""
    _model_args(p)
    _length_args(p, 64, output_len)
    p.add_argument("--concurrency", type=int, default=8, help="prompts at once (besides c=1)")


def _length_args(p: argparse.ArgumentParser, input_len: int, output_len: int, runs: int = 3):
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=output_len, help="tokens generated")
    p.add_argument("--runs", type=int, default=runs, help="timed runs (the median is reported)")


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks of an engine here (latency, baseline, determinism, plans, adaptive, "
        "graphs, speculative, structured, detokenize, ops, kv-sharing) or of a running server "
        "(serve)",
    )
    kinds = p.add_subparsers(dest="bench", required=True)
    _add_engine_benches(kinds)
    _add_step_benches(kinds)
    _add_serve_bench(kinds)


def _add_engine_benches(kinds) -> None:
    lat = kinds.add_parser("latency", help="single-request figures against their floors")
    _model_args(lat)
    lat.add_argument(
        "--input-lens", type=_ints, default=[64, 512, 2048], help="prompt lengths, comma-separated"
    )
    lat.add_argument("--output-len", type=int, default=64, help="tokens generated")
    lat.add_argument("--runs", type=int, default=3, help="timed runs (the median is reported)")
    lat.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    lat.set_defaults(func=cmd_latency)
    base = kinds.add_parser("baseline", help="rlt-hal vs the HF-module reference")
    _load_args(base)
    base.set_defaults(func=cmd_baseline)
    det = kinds.add_parser("determinism", help="throughput cost of --deterministic")
    _load_args(det)
    det.set_defaults(func=cmd_determinism)
    pl = kinds.add_parser(
        "plans", help="the default execution plan against each single-kernel plan, one run"
    )
    _load_args(pl)
    pl.set_defaults(func=cmd_plans)
    ad = kinds.add_parser(
        "adaptive",
        help="full compute, adaptive depth and depth-wise batching: speed, latency percentiles, "
        "depth and agreement",
    )
    _model_args(ad)
    _length_args(ad, 64, 32)
    ad.add_argument(
        "--concurrency", type=_ints, default=[1, 8], help="prompts at once, comma-separated"
    )
    ad.set_defaults(func=cmd_adaptive)


def _add_step_benches(kinds) -> None:
    gr = kinds.add_parser("graphs", help="decode steps eager vs step graphs: host calls, TPOT")
    _model_args(gr)
    gr.add_argument(
        "--batches", type=_ints, default=[1, 4], help="requests decoding at once, comma-separated"
    )
    _length_args(gr, 32, 16)
    gr.set_defaults(func=cmd_graphs)
    sp = kinds.add_parser(
        "speculative", help="self-speculative decoding (drafts from early loops) vs plain"
    )
    _load_args(sp, output_len=32)
    sp.add_argument("--loops-grid", type=_ints, default=[1, 2], help="values of E")
    sp.add_argument("--tokens-grid", type=_ints, default=[2, 4, 8], help="values of K")
    sp.set_defaults(func=cmd_speculative)
    st = kinds.add_parser(
        "structured", help="constrained decoding (a JSON schema, a regex) vs unconstrained"
    )
    _load_args(st, output_len=64)
    st.set_defaults(func=cmd_structured)
    dt = kinds.add_parser("detokenize", help="detokenising cost per token as the output grows")
    EngineArgs.add_cli_args(dt, fields=("model", "preset"))
    dt.add_argument(
        "--lengths",
        type=_ints,
        default=[100, 500, 1000, 2000],
        help="output lengths in tokens, comma-separated",
    )
    dt.add_argument("--runs", type=int, default=5, help="timed runs (the median is reported)")
    dt.add_argument("--json", metavar="OUT", help="also write the JSON report to OUT")
    dt.set_defaults(func=cmd_detokenize)
    ops = kinds.add_parser("ops", help="device ops per decode token and per layer pass (counted)")
    _model_args(ops)
    ops.add_argument("--steps", type=int, default=3, help="decode steps counted")
    ops.set_defaults(func=cmd_ops)
    kvs = kinds.add_parser("kv-sharing", help="long generations at a fixed pool: full vs shared KV")
    _load_args(kvs, output_len=2048)
    EngineArgs.add_cli_args(kvs, fields=("kv_cache_memory",))  # the pool both modes share
    kvs.set_defaults(func=cmd_kv_sharing, input_len=256, runs=1)


def _add_serve_bench(kinds) -> None:
    srv = kinds.add_parser("serve", help="streaming HTTP load through the OpenAI API")
    srv.add_argument(
        "--url", required=True, help="the server, e.g. http://127.0.0.1:8000/v1 (required)"
    )
    srv.add_argument("--model", help="served model name (default: the server's first)")
    srv.add_argument(
        "--concurrency",
        type=_ints,
        default=[1, 8],
        help="requests in flight, one level each, comma-separated",
    )
    srv.add_argument("--num-requests", type=int, default=16, help="requests per level")
    srv.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    srv.add_argument("--output-len", type=int, default=32, help="tokens generated")
    srv.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="every prompt is one prefix of this many tokens, then --input-len of its own; "
        "each level runs with no sharing (a cache salt per request: the baseline), then shared",
    )
    srv.add_argument("--json", metavar="OUT", help="also write the JSON report to OUT")
    srv.set_defaults(func=cmd_serve)


def _llm(args, tokens: int, spec_tokens: int | None = None, **overrides):
    """The engine of the command's options with a pool of ``tokens`` (and ``options``), plus
    the scratch blocks step graphs reserve for padding rows if they are on, for speculation
    with up to ``spec_tokens`` drafts (default: the options')."""
    from runtime_glue.engine.graphs import group_limits, scratch_blocks
    from runtime_glue.engine.llm import build_llm
    from runtime_glue.engine.refusals import DEFAULT_SPECULATIVE_TOKENS

    if spec_tokens is None and args.speculative_loops is not None:
        spec_tokens = args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS
    seqs = overrides.get("max_num_seqs", args.max_num_seqs)
    options = EngineArgs.from_cli_args(
        args,
        num_blocks=-(-tokens // args.block_size)
        + 1
        + scratch_blocks(group_limits(seqs, spec_tokens), args.block_size),
        max_num_batched_tokens=max(8192, tokens),
        enable_prefix_caching=False,
        **overrides,
    )
    return build_llm(options)


def _emit(args, report: dict, table: str, plans: list[str] | None = None) -> int:
    """The plan lines (default: every plan the report names), then the table; the report to
    ``--json OUT`` when given."""
    report["command"] = "rlt-hal " + " ".join(sys.argv[1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("\n".join([*(plan_lines(report) if plans is None else plans), table]))
    return 0


def plan_lines(report: dict) -> list[str]:
    """``plan: ...`` for every execution plan ``report`` names (a ``"plan"`` string at any
    depth), labelled with the key it sits under: the table then says what it ran."""
    lines: list[str] = []

    def visit(value: dict, label: str) -> None:
        for key, item in value.items():
            if key == "plan" and isinstance(item, str):
                lines.append(f"plan{f' ({label})' if label else ''}: {item}")
            elif isinstance(item, dict):
                visit(item, label if key == "plan" else key)

    visit(report, "")
    return lines


def _emit_model(args, report: dict, table: str) -> int:
    """``_emit`` for a benchmark of a checkpoint: the report names the preset it ran, if any."""
    report["preset"] = None if args.model else args.preset
    return _emit(args, report, table)


def _load_tokens(args) -> int:
    """Tokens the pool must hold for ``--concurrency`` prompts of the load arguments at once."""
    return args.concurrency * (args.input_len + args.output_len + args.block_size)


def cmd_latency(args) -> int:
    from runtime_glue.bench.engine_bench import latency, markdown_latency

    llm = _llm(args, max(args.input_lens) + args.output_len + 8)
    report = latency(llm, args.input_lens, args.output_len, args.runs, args.warmup)
    return _emit_model(args, report, markdown_latency(report))


def cmd_baseline(args) -> int:
    from runtime_glue.bench.engine_bench import baseline, markdown_baseline

    llm = _llm(args, _load_tokens(args))
    report = baseline(llm, args.input_len, args.output_len, args.runs, args.concurrency)
    return _emit_model(args, report, markdown_baseline(report))


def cmd_determinism(args) -> int:
    from runtime_glue.bench.engine_bench import determinism_cost, markdown_determinism

    tokens = _load_tokens(args)
    args.linear = args.linear or "torch"  # the same kernel both ways: the cost of the mode only
    args.deterministic = False
    default = _llm(args, tokens)
    args.deterministic = True
    deterministic = _llm(args, tokens)
    report = determinism_cost(
        default, deterministic, args.input_len, args.output_len, args.runs, args.concurrency
    )
    return _emit_model(args, report, markdown_determinism(report))


def cmd_plans(args) -> int:
    """Every plan shares one load of the weights and one KV pool."""
    from runtime_glue.bench.engine_bench import compare_plans, markdown_plans

    llm = _llm(args, _load_tokens(args))
    variants = {"default": llm}
    for kernel in llm.driver.kernels_for("linear"):
        try:
            variants[f"deterministic, {kernel.name} only"] = llm.variant(True, kernel.name)
        except RuntimeError as exc:  # cannot run here, or cannot keep the mode
            print(f"skipping {kernel.name}: {exc}", file=sys.stderr)
    variants["hf-exact (torch)"] = llm.variant(False)
    report = compare_plans(
        llm, variants, args.input_len, args.output_len, args.runs, args.concurrency
    )
    return _emit_model(args, report, markdown_plans(report))


def cmd_adaptive(args) -> int:
    from runtime_glue.bench.adaptive_bench import adaptive_depth, markdown_adaptive

    most = max(args.concurrency)
    tokens = most * (args.input_len + args.output_len + args.block_size)
    llm = _llm(args, tokens, max_num_seqs=max(most, args.max_num_seqs))
    report = adaptive_depth(llm, args.input_len, args.output_len, args.runs, args.concurrency)
    return _emit_model(args, report, markdown_adaptive(report))


def cmd_ops(args) -> int:
    from runtime_glue.bench.ops_bench import markdown_ops, ops_report

    llm = _llm(args, 4 * args.block_size)
    report = ops_report(llm, args.steps)
    return _emit_model(args, report, markdown_ops(report))


def cmd_graphs(args) -> int:
    from runtime_glue.bench.graph_bench import compare, markdown_graphs

    tokens = max(args.batches) * (args.input_len + 2 * args.output_len + args.block_size)
    args.max_num_seqs = max(args.max_num_seqs, *args.batches)
    eager = _llm(args, tokens, step_graphs=False)
    graphs = _llm(args, tokens, step_graphs=True)
    report = compare(eager, graphs, args.batches, args.input_len, args.output_len, args.runs)
    return _emit_model(args, report, markdown_graphs(report))


def cmd_speculative(args) -> int:
    from runtime_glue.bench.speculative_bench import markdown_speculative, speculative

    most = max(args.tokens_grid)  # and the rounds timed one by one (speculative_bench)
    tokens = _load_tokens(args) + args.concurrency * most + 4 * (most + 1) + args.input_len
    llm = _llm(args, tokens, spec_tokens=most)
    report = speculative(
        llm,
        args.loops_grid,
        args.tokens_grid,
        args.input_len,
        args.output_len,
        args.runs,
        args.concurrency,
    )
    return _emit_model(args, report, markdown_speculative(report))


def cmd_structured(args) -> int:
    from runtime_glue.bench.structured_bench import markdown_structured, structured

    llm = _llm(args, _load_tokens(args))
    report = structured(llm, args.input_len, args.output_len, args.runs, args.concurrency)
    return _emit_model(args, report, markdown_structured(report))


def cmd_detokenize(args) -> int:
    from runtime_glue.bench.detok_bench import detokenize, markdown_detokenize
    from runtime_glue.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(EngineArgs.from_cli_args(args).model_dir())
    report = detokenize(tokenizer, args.lengths, args.runs)
    return _emit(args, report, markdown_detokenize(report), ["plan: none (the tokenizer only)"])


def cmd_kv_sharing(args) -> int:
    from runtime_glue.bench.kv_sharing_bench import from_args, markdown_kv_sharing

    report = from_args(args)
    return _emit_model(args, report, markdown_kv_sharing(report))


def cmd_serve(args) -> int:
    from runtime_glue.bench.serve_bench import failed_everywhere, markdown_serve, serve

    report = serve(
        args.url,
        args.concurrency,
        args.num_requests,
        args.input_len,
        args.output_len,
        args.model,
        args.shared_prefix_len,
    )
    plan = "plan: the server's (its start-up lines name it)"
    code = _emit(args, report, markdown_serve(report), [plan])
    if failed_everywhere(report):
        first = report["levels"][0]
        sample = (first.get("unshared") or first)["error_samples"][:1]
        print(f"rlt-hal: error: every request failed (e.g. {sample[0] if sample else '?'})",
              file=sys.stderr)  # fmt: skip
        return 1
    return code
