"""``rlt-hal bench graphs``: decode steps eager against replayed step graphs.

:func:`host_calls_per_decode_step` counts, with a ``TorchDispatchMode``, what the engine asks
of the device in one decode step: every device op that is not a view, each
``hal.graphs.device_call`` once (a graph's replay, an emulated torch_npu op: the one host call
each stands for, not the torch ops that carry it out) and each fence it records. Under replay
that is the static-buffer copy, the replay, the read-back and the fence; eager, every op of
the forward. ``rlt-hal bench ops`` reports the same count.

On the emulated npu every figure is the emulation's: its graph re-runs and checks every op
of the step under a dispatch mode, so its TPOT measures the test double, not a graph; only the
host-call counts carry over to hardware.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hal.graphs import device_call, inside_device_call
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

_HOST_ONLY = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class HostCalls(TorchDispatchMode):
    """Host calls to the device while active, by name (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def heard(self, name: str) -> None:
        self.calls[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (inside_device_call() or func.is_view or func in _HOST_ONLY):
            self.calls[str(func)] += 1
        return out


def _decode_ready(llm: LLM, prompts: int, input_len: int, max_tokens: int) -> None:
    """Queue ``prompts`` greedy requests and step until every one is decoding."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    for i in range(prompts):
        ids = [(7 * i + 13 * j) % (llm.config.vocab_size - 3) + 3 for j in range(input_len)]
        engine.add_request(f"bench-{engine.num_steps}-{i}", ids, params)
    while any(r.in_prefill for r in engine.running) or engine.waiting:
        engine.step()


def _counted_step(llm: LLM) -> Counter[str]:
    from hal.graphs import listening

    engine = llm.engine
    record_fence = engine.device.record_fence
    counter = HostCalls()

    def fence():
        with device_call("record_fence"):
            return record_fence()

    engine.device.record_fence = fence  # type: ignore[method-assign]
    try:
        with listening(counter.heard), counter:
            engine.step()
    finally:
        del engine.device.record_fence  # the class's method again
    return counter.calls


def host_calls_per_decode_step(
    llm: LLM, prompts: int = 1, input_len: int = 16, steps: int = 4
) -> dict:
    """Host calls of ``steps`` decode steps of ``prompts`` requests (after one uncounted
    decode step, which captures the graph when ``llm`` has step graphs)."""
    _decode_ready(llm, prompts, input_len, steps + 2)
    graphs = llm.engine.graphs
    llm.engine.step()  # the capture, if any
    replayed = graphs.stats["graph_steps"] if graphs is not None else 0
    counts = [_counted_step(llm) for _ in range(steps)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    totals = [sum(c.values()) for c in counts]
    return {
        "device": llm.driver.label,
        "step_graphs": graphs.label if graphs is not None else None,
        "replayed": (graphs.stats["graph_steps"] - replayed) if graphs is not None else 0,
        "steps": steps,
        "batch": prompts,
        "host_calls_per_step": max(totals),
        "calls": dict(sorted(counts[-1].items(), key=lambda kv: -kv[1])[:12]),
    }


def host_calls_by_kind(llm: LLM, input_len: int = 16) -> dict[str, int]:
    """Host calls of each kind of decode step one request runs: ``decode`` (plain), or, with
    speculation, ``draft`` and ``verify`` (most over two rounds), or under depth-wise batching
    ``depth`` (most over two tokens); each step that was replayed, not run eagerly, counted
    once it is past its capture."""
    engine = llm.engine
    spec = llm.speculative
    rounds = 1 if spec is None else spec.tokens + 2  # steps of one round of drafts
    if engine.config.depth_batching:
        rounds = llm.config.total_ut_steps  # steps of one token
    _decode_ready(llm, 1, input_len, 6 * rounds + 2)
    kinds: dict[str, list[int]] = {}
    real_build = engine.builder.build
    seen: list[str] = []

    def build(plan):
        host = real_build(plan)
        g = host.groups
        kind = "depth" if g["depth"] else "verify" if g["verify"] else "draft"
        seen.append(kind if g["depth"] + g["verify"] + g["draft"] else "decode")
        return host

    engine.builder.build = build  # type: ignore[method-assign]
    try:
        for _ in range(2 * rounds):  # captures: every shape once
            engine.step()
        for _ in range(2 * rounds):
            before = engine.graphs.stats["graph_steps"] if engine.graphs is not None else 0
            calls = sum(_counted_step(llm).values())
            replayed = engine.graphs is not None and engine.graphs.stats["graph_steps"] > before
            if replayed:
                kinds.setdefault(seen[-1], []).append(calls)
    finally:
        del engine.builder.build  # the class's method again
    while engine.has_unfinished():
        engine.step()
    return {kind: max(calls) for kind, calls in kinds.items()}


def decode_tpot(llm: LLM, prompts: int, input_len: int, output_len: int, runs: int) -> float:
    """Median seconds of a decode step of ``prompts`` requests (prefill excluded)."""
    times = []
    for _ in range(runs):
        _decode_ready(llm, prompts, input_len, output_len)
        while llm.engine.has_unfinished():
            start = time.perf_counter()
            llm.engine.step()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(
    eager: LLM, graphs: LLM, batches: list[int], input_len: int, output_len: int, runs: int
) -> dict:
    rows = []
    for batch in batches:
        row: dict = {"batch": batch}
        for name, llm in (("eager", eager), ("graphs", graphs)):
            calls = host_calls_per_decode_step(llm, batch, input_len, steps=3)
            row[f"{name}_host_calls"] = calls["host_calls_per_step"]
            row[f"{name}_tpot_ms"] = 1e3 * decode_tpot(llm, batch, input_len, output_len, runs)
        row["replayed"] = calls["replayed"] == 3
        rows.append(row)
    emulated = "emulated" in eager.driver.label
    return {
        "device": eager.driver.label,
        "emulated": emulated,
        "mode": eager.mode,
        "plan": eager.plan.describe(),
        "step_graphs": graphs.engine.graphs.label if graphs.engine.graphs else None,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "rows": rows,
    }


def markdown_graphs(report: dict) -> str:
    label = " (EMULATED: TPOT measures the test double)" if report["emulated"] else ""
    lines = [
        f"step graphs on {report['device']}{label}, {report['mode']} mode, "
        f"{report['step_graphs']}; input {report['input_len']}, median of {report['runs']} runs",
        "",
        "| batch | eager host calls/step | graphs host calls/step | eager TPOT ms "
        "| graphs TPOT ms | every counted step replayed |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['batch']} | {r['eager_host_calls']} | {r['graphs_host_calls']} "
            f"| {r['eager_tpot_ms']:.2f} | {r['graphs_tpot_ms']:.2f} | {r['replayed']} |"
        )
    return "\n".join(lines)
