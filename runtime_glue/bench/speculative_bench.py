"""``rlt-hal bench speculative``: self-speculative decoding against plain decoding, one run.

For each (E, K) of a grid, on one load of the weights and one KV pool: TPOT and output tokens/s
at c=1 and c=N against plain decoding measured in the same run (runs interleaved), the
acceptance rate (drafts accepted / drafted), tokens per verify step, and whether the greedy
tokens equal plain decoding's (``prefix_agreement``: the share of plain decoding's tokens
reproduced before the first difference, which is what fast mode, promising no bits, is
measured by; ``bench adaptive``'s ``agreement`` counts equal tokens position by position).
Then, per (E, K), whole rounds of one request are timed step by step: the measured costs of a
draft step ``d`` and of a verify step of K + 1 rows ``v`` give the time per token a round
implies whatever the weights: ``((K + 1) d + v) / (K + 1)`` when every draft is accepted
(K + 1 tokens per round), ``(K + 1) d + v`` when none is (one token).

Prompts are held-out text of the trained checkpoint's corpus (``runtime_glue.ouro.corpus``),
so that a trained checkpoint shows its real acceptance.
"""

from __future__ import annotations

import statistics
import time

from runtime_glue.bench.engine_bench import machine
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams


def text_prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from held-out documents (repeated if short)."""
    from runtime_glue.ouro.corpus import documents, split

    _, held = split(documents(("topics",)))
    prompts = []
    for doc in held:
        ids = llm.encode(doc.text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    from runtime_glue.bench.engine_bench import _prompt

    while len(prompts) < count:  # too little text: random tokens
        prompts.append(_prompt(length, llm.config.vocab_size, seed=len(prompts)))
    return prompts


def _timed_run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt at once through ``llm``'s engine: TPOT (per request, median), tok/s and
    the tokens."""
    eng = llm.engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    reqs = []
    for i, p in enumerate(prompts):
        eng.add_request(f"spec-bench-{i}", p, params)
        reqs.append(eng.requests[f"spec-bench-{i}"])
    done: dict[str, float] = {}
    start = time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = time.monotonic()
    wall = time.perf_counter() - start
    tpot = [
        (done[r.request_id] - r.first_token_time) / max(output_len - 1, 1)
        for r in reqs
        if r.first_token_time is not None
    ]
    return {
        "tpot": statistics.median(tpot),
        "tok_s": output_len * len(prompts) / wall,
        "tokens": [list(r.output_ids) for r in reqs],
    }


def round_costs(llm: LLM, prompt: list[int], rounds: int) -> dict[str, list[float]]:
    """Wall time of every draft step and verify step of ``rounds`` whole rounds of one
    request (after its prefill), whatever they accept."""
    eng, spec = llm.engine, llm.engine.speculator
    assert spec is not None
    longest = rounds * (spec.config.tokens + 1) + spec.config.tokens + 2
    eng.add_request("spec-bench-round", prompt, SamplingParams(max_tokens=longest, ignore_eos=True))
    req = eng.requests["spec-bench-round"]
    steps: dict[str, list[float]] = {"draft": [], "verify": []}
    while req.in_prefill or not req.output_ids:
        eng.step()
    while len(steps["verify"]) < rounds:
        entry = spec.entry(req)
        assert entry is not None and entry.k == spec.config.tokens
        start = time.perf_counter()
        eng.step()
        steps[entry.kind].append(time.perf_counter() - start)
    eng.abort_request("spec-bench-round")
    return steps


def host_calls_per_token(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Host calls to the device per generated token of one request's decoding (its prefill
    excluded): with step graphs, a replayed draft or verify step's few; eager, every op's.
    The same request runs once uncounted first, so that graphs are captured for every shape
    it steps through (a capture is paid once per shape, not per token)."""
    from runtime_glue.bench.graph_bench import _counted_step

    eng, params = llm.engine, SamplingParams(max_tokens=output_len, ignore_eos=True)
    for counted in (False, True):
        eng.add_request(f"spec-bench-calls-{counted}", prompt, params)
        req = eng.requests[f"spec-bench-calls-{counted}"]
        while req.in_prefill or not req.output_ids:
            eng.step()
        first, calls = len(req.output_ids), 0
        while eng.has_unfinished():
            if not counted:
                eng.step()
                continue
            calls += sum(_counted_step(llm).values())
    return calls / max(output_len - first, 1)


def speculative(
    llm: LLM,
    loops: list[int],
    tokens: list[int],
    input_len: int,
    output_len: int,
    runs: int,
    concurrency: int,
) -> dict:
    plain = llm.with_speculation(None)
    prompts = text_prompts(llm, concurrency, input_len)
    levels = {"c1": prompts[:1]}
    if concurrency > 1:
        levels[f"c{concurrency}"] = prompts
    variants = {(e, k): llm.with_speculation(e, k) for e in loops for k in tokens}
    for batch in levels.values():  # warm-up: first calls pay for allocation
        _timed_run(plain, batch, 2)
    costs = {key: round_costs(v, prompts[0], rounds=max(runs, 2)) for key, v in variants.items()}
    calls = {f"E{e}K{k}": host_calls_per_token(v, prompts[0], output_len)
             for (e, k), v in variants.items()}  # fmt: skip
    calls["plain"] = host_calls_per_token(plain, prompts[0], output_len)
    samples: dict = {lv: {key: [] for key in ["plain", *variants]} for lv in levels}
    for _ in range(runs):
        for lv, batch in levels.items():
            samples[lv]["plain"].append(_timed_run(plain, batch, output_len))
            for key, v in variants.items():
                before = dict(v.engine.stats)
                got = _timed_run(v, batch, output_len)
                got["stats"] = {k: v.engine.stats[k] - before[k] for k in before}
                samples[lv][key].append(got)
    report = _report(llm, plain, variants, samples, costs, input_len, output_len, runs)
    report["host_calls_per_token"] = calls
    report["step_graphs"] = None if plain.engine.graphs is None else plain.engine.graphs.label
    return report


def prefix_agreement(got: list[dict], plain: list[dict]) -> float:
    """The share of plain decoding's tokens that ``got`` reproduced before its first difference,
    over every request of every run (1.0: the same outputs; a parting in a request's first
    token, at a near-tie say, counts that request's whole output as lost)."""
    same = total = 0
    for run, base in zip(got, plain, strict=True):
        for mine, want in zip(run["tokens"], base["tokens"], strict=True):
            parted = (i for i, (a, b) in enumerate(zip(mine, want, strict=False)) if a != b)
            same += next(parted, min(len(mine), len(want)))
            total += len(want)
    return same / total if total else 1.0


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _report(llm, plain, variants, samples, costs, input_len, output_len, runs) -> dict:
    report: dict = {
        "machine": machine(),
        "device": llm.driver.label,
        "plan": plain.plan.describe(),
        "loops": llm.config.total_ut_steps,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "levels": {},
    }
    for lv, by in samples.items():
        base_tpot = statistics.median([s["tpot"] for s in by["plain"]])
        base_tok_s = statistics.median([s["tok_s"] for s in by["plain"]])
        rows = []
        for e, k in variants:
            got = by[(e, k)]
            drafted = sum(s["stats"]["spec_drafted"] for s in got)
            accepted = sum(s["stats"]["spec_accepted"] for s in got)
            verifies = sum(s["stats"]["spec_verify_steps"] for s in got)
            tpot = statistics.median([s["tpot"] for s in got])
            tok_s = statistics.median([s["tok_s"] for s in got])
            row = {
                "E": e,
                "K": k,
                "tpot_s": tpot,
                "tok_s": tok_s,
                "tpot_ratio": tpot / base_tpot,
                "speedup": tok_s / base_tok_s,
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_verify": (accepted + verifies) / verifies if verifies else None,
                "identical": all(
                    s["tokens"] == b["tokens"] for s, b in zip(got, by["plain"], strict=True)
                ),
                "prefix_agreement": prefix_agreement(got, by["plain"]),
            }
            d, v = _med(costs[(e, k)]["draft"]), _med(costs[(e, k)]["verify"])
            if d is not None and v is not None:
                round_s = (k + 1) * d + v
                row.update(
                    draft_step_s=d,
                    verify_step_s=v,
                    tpot_at_acceptance_1_s=round_s / (k + 1),
                    tpot_at_acceptance_0_s=round_s,
                    at_acceptance_1_over_plain=round_s / (k + 1) / base_tpot,
                )
            rows.append(row)
        report["levels"][lv] = {"plain_tpot_s": base_tpot, "plain_tok_s": base_tok_s, "grid": rows}
    return report


def markdown_speculative(report: dict) -> str:
    graphs = report.get("step_graphs") or "none"
    calls = ", ".join(f"{k} {v:.1f}" for k, v in report.get("host_calls_per_token", {}).items())
    lines = [f"step graphs: {graphs}; host calls per generated token: {calls}"]
    for lv, r in report["levels"].items():
        lines += [
            f"\n{lv}: plain decoding TPOT {r['plain_tpot_s'] * 1e3:.1f} ms, "
            f"{r['plain_tok_s']:.2f} tok/s\n",
            "| E | K | TPOT ms | vs plain | tok/s | speed-up | acceptance | tokens/verify "
            "| identical | draft step ms | verify step ms | TPOT at acc. 1 (vs plain) "
            "| TPOT at acc. 0 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for g in r["grid"]:
            acc = "-" if g["acceptance"] is None else f"{g['acceptance']:.1%}"
            tpv = "-" if g["tokens_per_verify"] is None else f"{g['tokens_per_verify']:.2f}"
            same = "yes" if g["identical"] else f"NO ({g['prefix_agreement']:.2%} agree)"
            costs = "- | - | - | -"
            if "draft_step_s" in g:
                costs = (
                    f"{g['draft_step_s'] * 1e3:.1f} | {g['verify_step_s'] * 1e3:.1f} | "
                    f"{g['tpot_at_acceptance_1_s'] * 1e3:.1f} "
                    f"({g['at_acceptance_1_over_plain']:.2f}x) | "
                    f"{g['tpot_at_acceptance_0_s'] * 1e3:.1f}"
                )
            lines.append(
                f"| {g['E']} | {g['K']} | {g['tpot_s'] * 1e3:.1f} | {g['tpot_ratio']:.2f}x | "
                f"{g['tok_s']:.2f} | {g['speedup']:.2f}x | {acc} | {tpv} | "
                f"{same} | {costs} |"
            )
    return "\n".join(lines)
