"""``rlt-hal bench structured``: constrained decoding (structured outputs) against unconstrained
decoding, in the same run, at c=1 and c=N.

Every variant samples (temperature 1, a seed per request), so every step reads the logits back
in all of them: what differs is the grammar's work. Per generated token it reports TPOT and
tokens/s, and three timed parts of the sampling stage: the mask's computation (llguidance's
bitmask for the row, unpacked to a bool ``[vocab]`` mask: ``Matcher.allowed_after``), its
application (the masked copy of the logits row: ``sampling.process``) and advancing the matcher
by the chosen token (``Matcher.accept``). The grammars are long enough that no output ends
before ``--output-len``: a JSON array of 64 small objects (compact, bounded integers and
strings) and a regex of 100 dates.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import defaultdict

from runtime_glue.bench.engine_bench import machine
from runtime_glue.bench.speculative_bench import text_prompts
from runtime_glue.engine import sampler as sampler_module
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.structured import Matcher

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fox"]},
    },
    "required": ["id", "name", "kind"],
    "additionalProperties": False,
}
SPECS: dict[str, dict | None] = {
    "none": None,
    "json": {
        "json": {"type": "array", "items": ITEM, "minItems": 64, "maxItems": 64},
        "disable_any_whitespace": True,
    },
    "regex": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [0-9]{4}-[0-9]{2}-[0-9]{2}){99}"},
}


class _Timers:
    """Seconds spent in the sampling stage's grammar parts, while ``timed`` is on."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def timed(self):
        saved = (Matcher.allowed_after, Matcher.accept, sampler_module.process)
        Matcher.allowed_after = self.wrap("mask", saved[0])  # type: ignore[method-assign]
        Matcher.accept = self.wrap("accept", saved[1])  # type: ignore[method-assign]
        sampler_module.process = self.wrap("apply", saved[2])
        try:
            yield self
        finally:
            Matcher.allowed_after, Matcher.accept = saved[0], saved[1]  # type: ignore[method-assign]
            sampler_module.process = saved[2]


def _run(llm: LLM, prompts: list[list[int]], output_len: int, spec: dict | None) -> dict:
    """Every prompt at once: TPOT (median per request), tok/s, tokens and the stage's parts."""
    eng = llm.engine
    reqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=True,
            structured_outputs=spec,
        )  # fmt: skip
        eng.add_request(f"structured-bench-{i}", p, params)
        reqs.append(eng.requests[f"structured-bench-{i}"])
    done: dict[str, float] = {}
    timers = _Timers()
    with timers.timed():
        start = time.perf_counter()
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = time.monotonic()
        wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    tpot = [
        (done[r.request_id] - r.first_token_time) / max(len(r.output_ids) - 1, 1)
        for r in reqs
        if r.first_token_time is not None
    ]
    return {
        "tpot": statistics.median(tpot),
        "tok_s": tokens / wall,
        "tokens": tokens,
        **{f"{k}_s": timers.seconds.get(k, 0.0) for k in ("mask", "apply", "accept")},
    }


def structured(llm: LLM, input_len: int, output_len: int, runs: int, concurrency: int) -> dict:
    prompts = text_prompts(llm, concurrency, input_len)
    levels = {"c1": prompts[:1]}
    if concurrency > 1:
        levels[f"c{concurrency}"] = prompts
    llm.engine.prewarm_grammars()
    for batch in levels.values():  # warm-up: every shape and position once, each grammar compiled
        for spec in SPECS.values():
            _run(llm, batch, output_len, spec)
    samples: dict = {lv: {kind: [] for kind in SPECS} for lv in levels}
    for _ in range(runs):
        for lv, batch in levels.items():  # interleaved: a load change hits every variant
            for kind, spec in SPECS.items():
                samples[lv][kind].append(_run(llm, batch, output_len, spec))
    report: dict = {
        "machine": machine(),
        "device": llm.driver.label,
        "plan": llm.plan.describe(),
        "vocab_size": llm.config.vocab_size,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "specs": {k: json.dumps(v) for k, v in SPECS.items() if v is not None},
        "levels": {},
    }
    for lv, by in samples.items():
        base = statistics.median(s["tpot"] for s in by["none"])
        rows = []
        for kind, got in by.items():
            tpot = statistics.median(s["tpot"] for s in got)
            row = {
                "kind": kind,
                "tpot_s": tpot,
                "tpot_ratio": tpot / base,
                "tpot_added_s": tpot - base,
                "tok_s": statistics.median(s["tok_s"] for s in got),
                "tokens": statistics.median(s["tokens"] for s in got),
            }
            for part in ("mask", "apply", "accept"):  # per generated token
                row[f"{part}_s_per_token"] = statistics.median(
                    s[f"{part}_s"] / max(s["tokens"], 1) for s in got
                )
            rows.append(row)
        report["levels"][lv] = rows
    return report


def markdown_structured(report: dict) -> str:
    lines = [
        f"vocabulary {report['vocab_size']}, prompts of {report['input_len']} tokens, "
        f"{report['output_len']} tokens per request, median of {report['runs']} runs; every "
        "variant samples (temperature 1), so all read the logits back",
    ]
    for lv, rows in report["levels"].items():
        lines += [
            f"\n{lv}:\n",
            "| grammar | TPOT ms | vs none | TPOT added ms | tok/s | mask µs/token "
            "| apply µs/token | accept µs/token | tokens |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['kind']} | {r['tpot_s'] * 1e3:.2f} | {r['tpot_ratio']:.2f}x | "
                f"{r['tpot_added_s'] * 1e3:.2f} | {r['tok_s']:.1f} | "
                f"{r['mask_s_per_token'] * 1e6:.0f} | {r['apply_s_per_token'] * 1e6:.0f} | "
                f"{r['accept_s_per_token'] * 1e6:.0f} | {r['tokens']:.0f} |"
            )
    return "\n".join(lines)
