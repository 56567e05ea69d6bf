"""``rlt-hal bench adaptive``: full compute, adaptive depth and depth-wise batching on one load
of the weights (docs/depth-batching.md): tokens/s at several concurrencies, each request's TTFT
and TPOT, loops per token, agreement with full compute and, where step graphs replay, host
calls per decode token."""

from __future__ import annotations

import statistics
import time

from runtime_glue.bench.engine_bench import _prompt, machine
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

VARIANTS = ("full", "adaptive", "depth")


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _timed_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """``prompts`` run together: tokens/s over the run, each request's TTFT and TPOT, and its
    outputs (token ids and exit loops, in order)."""
    engine = llm.engine
    start = time.perf_counter()
    ids = [f"bench-{engine.num_steps}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    final = {}
    while engine.has_unfinished():
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            if u.new_token_ids:
                first.setdefault(u.request_id, now)
                last[u.request_id] = now
            if u.finished:
                final[u.request_id] = u
    elapsed = time.perf_counter() - start
    n = params.max_tokens
    ttft = [first[r] - start for r in ids]
    tpot = [(last[r] - first[r]) / max(n - 1, 1) for r in ids]
    outs = [(final[r].token_ids, final[r].exit_steps) for r in ids]
    return n * len(prompts) / elapsed, ttft, tpot, outs


def _host_calls_per_token(llm: LLM, input_len: int, tokens: int = 6) -> float:
    """Host calls per generated token of one request decoding (after its prefill and enough
    steps to capture every shape its tokens use, when ``llm`` has step graphs)."""
    from runtime_glue.bench.graph_bench import _counted_step, _decode_ready

    loops = llm.config.total_ut_steps
    _decode_ready(llm, 1, input_len, 3 * tokens + 4)
    [req] = llm.engine.running
    for _ in range(2 * loops):  # captures
        llm.engine.step()
    before, calls = len(req.output_ids), 0
    while len(req.output_ids) - before < tokens and not req.finished:
        calls += sum(_counted_step(llm).values())
    made = len(req.output_ids) - before
    llm.engine.abort_request(req.request_id)
    return calls / max(made, 1)


def adaptive_depth(
    llm: LLM, input_len: int, output_len: int, runs: int, concurrency: list[int]
) -> dict:
    """Full compute against adaptive depth (``llm`` with the plan's exit threshold) and
    adaptive depth with depth-wise batching (``--depth-batching``: a token leaves its step's
    batch after its exit loop), on one load of the weights, runs interleaved, at each of
    ``concurrency``: tokens/s, each request's TTFT and TPOT (p50, p90), the mean number of
    loops a generated token ran, how many tokens equal full compute's, and whether depth-wise
    batching gave adaptive depth's tokens. Where the driver captures step graphs (and the
    engine was asked for them), full compute and depth-wise batching replay them (adaptive
    depth cannot) and the report has host calls per decode token for each."""
    graphs = bool(llm.args.step_graphs) and llm.driver.step_graphs() is not None
    full = llm.variant(adaptive_depth=False)
    adaptive = llm.variant(adaptive_depth=True, step_graphs=False)
    depth = llm.variant(adaptive_depth=True, depth_batching=True)
    variants = dict(zip(VARIANTS, (full, adaptive, depth), strict=True))
    vocab, loops = llm.config.vocab_size, llm.config.total_ut_steps
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    prompts = [_prompt(input_len, vocab, seed=i) for i in range(max(concurrency))]
    levels = {f"c{c}": prompts[:c] for c in concurrency}
    runs_of: dict[str, dict[str, list]] = {k: {v: [] for v in VARIANTS} for k in levels}
    for variant in variants.values():  # untimed: the first touch of the weights, captures
        variant.generate(prompts[:1], SamplingParams(max_tokens=2 * loops, ignore_eos=True))
    for _ in range(runs):
        for level, batch in levels.items():
            for name, variant in variants.items():
                runs_of[level][name].append(_timed_batch(variant, batch, params))
    widest = f"c{max(concurrency)}"
    outs = {name: runs_of[widest][name][-1][3] for name in VARIANTS}
    pairs = list(zip(outs["full"], outs["adaptive"], strict=True))
    same = sum(a == b for (f, _), (d, _) in pairs for a, b in zip(f, d, strict=True))
    # Loops a decode token ran: its exit loop + 1 (the first token comes from the prefill).
    ran = [s + 1 for _, (_, steps) in pairs for s in steps[1:]]
    full_depth = [s + 1 for (_, steps), _ in pairs for s in steps[1:]]
    report = {
        "machine": machine(),
        "device": llm.driver.label,
        "plan": adaptive.plan.describe(),
        "step_graphs": graphs,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "loops": loops,
        "mean_loops_adaptive": statistics.mean(ran),
        "mean_exit_depth_full": statistics.mean(full_depth),
        "agreement": same / (len(pairs) * output_len),
        "depth_equals_adaptive": outs["adaptive"] == outs["depth"],
        "levels": {},
    }
    for lv, by in runs_of.items():
        med = {v: statistics.median(r[0] for r in by[v]) for v in VARIANTS}
        latency = {}
        for v in VARIANTS:
            ttft = [t for r in by[v] for t in r[1]]
            tpot = [t for r in by[v] for t in r[2]]
            latency[v] = {
                "ttft_p50": _percentile(ttft, 0.5),
                "ttft_p90": _percentile(ttft, 0.9),
                "tpot_p50": _percentile(tpot, 0.5),
                "tpot_p90": _percentile(tpot, 0.9),
            }
        report["levels"][lv] = {
            "full_tok_s": med["full"],
            "adaptive_tok_s": med["adaptive"],
            "depth_tok_s": med["depth"],
            "speedup": med["adaptive"] / med["full"],
            "depth_speedup": med["depth"] / med["full"],
            "latency": latency,
        }
    if graphs:
        report["host_calls_per_token"] = {
            name: _host_calls_per_token(v, input_len) for name, v in variants.items()
        }
    return report


def markdown_adaptive(report: dict) -> str:
    lines = [
        "| concurrency | full compute tok/s | adaptive depth tok/s | speed-up | "
        "depth-wise batching tok/s | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for level, r in report["levels"].items():
        lines.append(
            f"| {level} | {r['full_tok_s']:.2f} | {r['adaptive_tok_s']:.2f} | {r['speedup']:.2f}x "
            f"| {r['depth_tok_s']:.2f} | {r['depth_speedup']:.2f}x |"
        )
    lines += [
        "",
        "| concurrency | variant | TTFT p50 (s) | TTFT p90 (s) | TPOT p50 (s) | TPOT p90 (s) |",
        "|---|---|---|---|---|---|",
    ]
    for level, r in report["levels"].items():
        for name, t in r["latency"].items():
            lines.append(
                f"| {level} | {name} | {t['ttft_p50']:.4f} | {t['ttft_p90']:.4f} | "
                f"{t['tpot_p50']:.4f} | {t['tpot_p90']:.4f} |"
            )
    calls = report.get("host_calls_per_token")
    if calls:
        lines.append(
            "\nhost calls per decode token (step graphs where they run): "
            + ", ".join(f"{name} {c:.1f}" for name, c in calls.items())
        )
    lines.append(
        f"\nloops per decode token: {report['mean_loops_adaptive']:.2f} of {report['loops']} "
        f"(the threshold's exit depth with every loop run: {report['mean_exit_depth_full']:.2f}); "
        f"tokens equal to full compute's: {report['agreement']:.1%}; depth-wise batching "
        f"gave adaptive depth's tokens: {'yes' if report['depth_equals_adaptive'] else 'NO'}"
    )
    return "\n".join(lines)
