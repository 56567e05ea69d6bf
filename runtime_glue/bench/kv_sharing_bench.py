"""``rlt-hal bench kv-sharing``: long generations at a fixed KV pool, full KV against
``--kv-sharing last``, in one run.

For each mode: the most requests served concurrently without preemption (measured: that many
submitted at once all run together with no preemption, and one more does not), the throughput
of both modes under the same load (the sharing mode's capacity, submitted at once), and TPOT
of a lone request. The capacity is a property of the pool's accounting (a generated token
costs 1/T of a prompt token under sharing), so a small model shows it as well as a large one;
the throughput and TPOT figures are the model's own.
"""

from __future__ import annotations

import statistics
import time

from runtime_glue.bench.engine_bench import _one_run, _prompt, machine
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

DEFAULT_POOL = 16 << 20  # bytes; the figure is a ratio, any pool shows it


def predicted_capacity(llm: LLM, input_len: int, output_len: int) -> int:
    """The most requests the pool's accounting admits at once, each to its last token."""
    bs, blocks = llm.kv_layout.block_size, llm.kv_layout.num_blocks
    loops = llm.config.total_ut_steps
    prompt = -(-input_len // bs)
    generated = -(-(output_len - 1) // bs)
    c = 0
    while True:
        n = c + 1
        if llm.engine.shared is None:
            need = n * (-(-(input_len + output_len - 1) // bs))
        else:
            need = n * prompt + -(-(n * generated) // loops)
        if need > blocks:
            return c
        c = n


def load(llm: LLM, n: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    """``n`` requests submitted at once: whether they all ran together, preemptions, speed."""
    eng = llm.engine
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    before = eng.stats["preemptions"]
    start = time.perf_counter()
    for i in range(n):
        eng.add_request(f"kv-{seed}-{i}", _prompt(input_len, vocab, seed * 1000 + i), params)
    peak = tokens = 0
    while eng.has_unfinished():
        tokens += len(eng.step())
        peak = max(peak, len(eng.running))
    wall = time.perf_counter() - start
    preemptions = eng.stats["preemptions"] - before
    return {
        "requests": n,
        "peak_running": peak,
        "preemptions": preemptions,
        "served_together_without_preemption": peak == n and preemptions == 0,
        "wall_s": wall,
        "tok_s": tokens / wall,
    }


def capacity(llm: LLM, input_len: int, output_len: int) -> dict:
    """The largest ``c`` whose load runs together without preemption, with the ``c + 1`` run
    that does not (measured around the accounting's prediction)."""
    c = predicted_capacity(llm, input_len, output_len)
    ok = load(llm, c, input_len, output_len, seed=1)
    while not ok["served_together_without_preemption"] and c > 1:
        c -= 1
        ok = load(llm, c, input_len, output_len, seed=1)
    over = load(llm, c + 1, input_len, output_len, seed=2)
    return {"capacity": c, "at_capacity": ok, "one_more": over}


def kv_sharing(full: LLM, shared: LLM, input_len: int, output_len: int, runs: int) -> dict:
    report: dict = {
        "machine": machine(),
        "checkpoint": str(full.model_dir),
        "plan": full.plan.describe(),
        "pool": full.kv_summary,
        "pool_shared": shared.kv_summary,
        "input_len": input_len,
        "output_len": output_len,
        "modes": {},
    }
    for name, llm in (("none", full), ("last", shared)):
        report["modes"][name] = capacity(llm, input_len, output_len)
    load_n = report["modes"]["last"]["capacity"]
    for name, llm in (("none", full), ("last", shared)):
        mode = report["modes"][name]
        mode["same_load"] = load(llm, load_n, input_len, output_len, seed=3)
        prompt = _prompt(input_len, llm.config.vocab_size, 7)
        singles = [_one_run(llm, prompt, output_len) for _ in range(runs)]
        mode["c1_tpot_s"] = statistics.median(r["tpot"] for r in singles)
        mode["c1_tok_s"] = statistics.median(r["tok_s"] for r in singles)
    none, last = report["modes"]["none"], report["modes"]["last"]
    report["capacity_ratio"] = last["capacity"] / max(none["capacity"], 1)
    report["same_load_throughput_ratio"] = last["same_load"]["tok_s"] / none["same_load"]["tok_s"]
    report["c1_tpot_ratio"] = last["c1_tpot_s"] / none["c1_tpot_s"]
    return report


def from_args(args) -> dict:
    """The report for ``rlt-hal bench kv-sharing``'s options: both modes, one pool size."""
    from runtime_glue.engine.args import EngineArgs
    from runtime_glue.engine.llm import build_llm

    def side(mode: str) -> LLM:
        return build_llm(
            EngineArgs.from_cli_args(
                args,
                kv_cache_memory=args.kv_cache_memory or DEFAULT_POOL,
                max_num_seqs=256,
                enable_prefix_caching=False,
                kv_sharing=mode,
            )
        )

    return kv_sharing(side("none"), side("last"), args.input_len, args.output_len, args.runs)


def markdown_kv_sharing(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"{report['input_len']} prompt + {report['output_len']} generated tokens per request; "
        f"{report['pool']}",
        f"machine: {m['processor']}, flags {' '.join(m['cpu_flags'])}, {m['cpu_count']} cpus",
        "",
        "| kv sharing | served at once, no preemption | one more: peak / preemptions | "
        "same load: tok/s (preemptions) | c=1 TPOT |",
        "|---|---|---|---|---|",
    ]
    for name, r in report["modes"].items():
        over, same = r["one_more"], r["same_load"]
        lines.append(
            f"| {name} | {r['capacity']} | {over['peak_running']} / {over['preemptions']} | "
            f"{same['tok_s']:.1f} ({same['preemptions']}) | {r['c1_tpot_s'] * 1e3:.2f} ms |"
        )
    lines.append(
        f"\ncapacity ratio {report['capacity_ratio']:.2f}x; throughput at the same load "
        f"{report['same_load_throughput_ratio']:.2f}x; c=1 TPOT ratio {report['c1_tpot_ratio']:.2f}"
    )
    return "\n".join(lines)
