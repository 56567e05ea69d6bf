"""xgrammar against llguidance on this machine, at Ouro's vocabulary size (49152).

What is measured, for each engine and each grammar kind (a nested JSON schema, a regex, a
choice list, a small EBNF grammar):

- compile: a cold compile (no cache) of the grammar for the tokenizer, median of --reps;
- first mask: the first token mask after compiling (llguidance builds its lexer lazily, so
  part of its compile work moves here; the sum is the time to the first token);
- mask: the per-token cost of computing the token bitmask while advancing a matcher through
  the SAME token sequence for both engines, median and p90 over every position of every walk;
- accept: the per-token cost of advancing the matcher by one token.

Two walks per grammar, replayed identically by both engines: the canonical BPE tokens of a
valid output (then EOS: what a model that follows the schema emits), and --walks seeded
random walks that pick uniformly among the tokens BOTH engines allow (up to --max-walk
tokens or termination). A position where the engines disagree is counted, not hidden.

The cost of applying a mask to a float32 logits row is engine-independent (both engines give
the same int32 bitmask); it is measured once, for xgrammar's CPU kernel and for the plain
torch unpack + masked_fill that ``runtime_glue.engine.structured`` uses.

The tokenizer is a real byte-level BPE with exactly 49152 tokens trained with ``tokenizers``
on what every Python ships (the reference manual's topics, stdlib docstrings and the stdlib's
own source, see ``runtime_glue.ouro.corpus``), wrapped as a transformers
``PreTrainedTokenizerFast`` and handed to each engine the way it documents
(``xgrammar.TokenizerInfo.from_huggingface``, ``llguidance.hf.from_tokenizer``).

    python benchmarks/grammar_engines.py [--engines xgrammar,llguidance] [--json out.json]

This script measures and reports; beside it, ``grammar_cases.py`` holds the grammars, their
valid outputs, the JSON Schema coverage cases and the tokenizer, and ``grammar_adapters.py``
the two engines behind one interface and the bitmask helpers. It finds them (and
``runtime_glue``) from its own path, so it runs from any directory.

Single-threaded on purpose (one core per request is what a server can count on): run it with
nothing else busy, and read the load average it prints beside the figures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # llguidance's pool, before it loads
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))  # grammar_cases, grammar_adapters, however run

from grammar_adapters import Llguidance, Xgrammar, allowed_ids, apply_bitmask, is_allowed  # noqa: E402
from grammar_cases import CASES, COVERAGE, EOS_IDS, VOCAB, build_tokenizer  # noqa: E402


def random_walks(engines, compiled, vocab, walks, max_walk, seed=0):
    """Seeded walks over tokens every engine allows: each engine sees the same sequence.
    Returns the walks and the number of positions where the engines' masks differ."""
    import torch

    out, differ = [], 0
    masks = [torch.zeros(-(-vocab // 32), dtype=torch.int32) for _ in engines]
    for w in range(walks):
        rng = random.Random(seed + w)
        ms = [e.matcher(c) for e, c in zip(engines, compiled, strict=True)]
        seq: list[int] = []
        while len(seq) < max_walk and not any(e.done(m) for e, m in zip(engines, ms, strict=True)):
            for e, m, mask in zip(engines, ms, masks, strict=True):
                e.fill(m, mask)
            sets = [allowed_ids(mask, vocab) for mask in masks]
            differ += any(s != sets[0] for s in sets)
            both = set.intersection(*sets)
            if not both:
                break
            token = rng.choice(sorted(both))
            seq.append(token)
            for e, m in zip(engines, ms, strict=True):
                e.accept(m, token)
        out.append(seq)
    return out, differ


def replay(engine, compiled, seqs, vocab) -> dict:
    """Per-token mask, apply and accept times over ``seqs`` (each from the grammar's start)."""
    import torch

    mask = torch.zeros(-(-vocab // 32), dtype=torch.int32)
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    row = torch.empty(vocab)
    fill_ns, apply_ns, accept_ns, refused = [], [], [], 0
    for seq in seqs:
        m = engine.matcher(compiled)
        for token in seq:
            t0 = time.perf_counter_ns()
            engine.fill(m, mask)
            t1 = time.perf_counter_ns()
            row.copy_(base)
            t2 = time.perf_counter_ns()
            apply_bitmask(mask, row, vocab)
            t3 = time.perf_counter_ns()
            ok = is_allowed(mask, token)
            t4 = time.perf_counter_ns()
            ok = engine.accept(m, token) and ok
            t5 = time.perf_counter_ns()
            if not ok:
                refused += 1
                break
            fill_ns.append(t1 - t0)
            apply_ns.append(t3 - t2)
            accept_ns.append(t5 - t4)
    return {"fill_ns": fill_ns, "apply_ns": apply_ns, "accept_ns": accept_ns, "refused": refused}


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3 if xs else float("nan")


def bench_case(engines, case, hf, vocab, reps, walks, max_walk) -> list[dict]:
    import torch

    kind, text, sample = CASES[case]
    rows, compiled = [], []
    for e in engines:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            c = e.compile(kind, text)
            times.append(time.perf_counter() - t0)
        m = e.matcher(c)
        mask = torch.zeros(-(-vocab // 32), dtype=torch.int32)
        t0 = time.perf_counter()
        e.fill(m, mask)
        first = time.perf_counter() - t0
        compiled.append(c)
        rows.append(
            {
                "engine": e.name,
                "case": case,
                "compile_ms": 1e3 * statistics.median(times),
                "first_mask_ms": 1e3 * first,
            }
        )
    canonical = hf.encode(sample, add_special_tokens=False) + [EOS_IDS[1]]
    walked, differ = random_walks(engines, compiled, vocab, walks, max_walk)
    for e, c, row in zip(engines, compiled, rows, strict=True):
        rep = replay(e, c, [canonical], vocab)
        row["refused_canonical"] = rep["refused"]
        row["canonical_tokens"] = len(canonical)
        walk = replay(e, c, walked, vocab)
        row["refused_walk"] = walk["refused"]
        row["walk_tokens"] = sum(map(len, walked))
        row["mask_us_median"] = pct(rep["fill_ns"] + walk["fill_ns"], 0.5)
        row["mask_us_p90"] = pct(rep["fill_ns"] + walk["fill_ns"], 0.9)
        row["mask_us_canonical_median"] = pct(rep["fill_ns"], 0.5)
        row["mask_us_walk_median"] = pct(walk["fill_ns"], 0.5)
        row["accept_us_median"] = pct(rep["accept_ns"] + walk["accept_ns"], 0.5)
        row["apply_us_median"] = pct(rep["apply_ns"] + walk["apply_ns"], 0.5)
        row["walk_masks_differ"] = differ
    if "llguidance" in [e.name for e in engines]:
        rows.append(bench_module(hf, vocab, case, [canonical, *walked]))
    return rows


def bench_module(hf, vocab: int, case: str, seqs: list[list[int]]) -> dict:
    """``runtime_glue.engine.structured`` over the same walks: ``allowed()`` (the engine's
    bitmask, unpacked to a bool [vocab] mask, EOS set), ``apply()`` on a float32 row (its mask
    included) and ``accept()``."""
    import torch

    from runtime_glue.engine.structured import GrammarCompiler, parse_structured

    kind, text, _ = CASES[case]
    value = json.loads(text) if kind in ("json", "choice") else text
    spec = parse_structured({kind: value, "disable_any_whitespace": kind == "json"})
    compiler = GrammarCompiler(hf, vocab, eos_token_ids=EOS_IDS)
    compiler.compile(spec)  # the tokenizer table, built once per model
    compiler._cache.clear()
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    compile_s = time.perf_counter() - t0
    allowed_ns, apply_ns, accept_ns = [], [], []
    out, row = torch.empty(vocab, dtype=torch.bool), torch.empty(vocab)
    for seq in seqs:
        m = compiler.matcher(compiled)
        for token in seq:
            t0 = time.perf_counter_ns()
            m.allowed(out)
            t1 = time.perf_counter_ns()
            row.normal_()
            t2 = time.perf_counter_ns()
            m.apply(row)
            t3 = time.perf_counter_ns()
            if not m.accept(token):
                break
            t4 = time.perf_counter_ns()
            allowed_ns.append(t1 - t0)
            apply_ns.append(t3 - t2)
            accept_ns.append(t4 - t3)
    return {
        "engine": "structured.py",
        "case": case,
        "compile_ms": 1e3 * compile_s,
        "allowed_us_median": pct(allowed_ns, 0.5),
        "allowed_us_p90": pct(allowed_ns, 0.9),
        "apply_with_mask_us_median": pct(apply_ns, 0.5),
        "accept_us_median": pct(accept_ns, 0.5),
        "tokens": len(allowed_ns),
    }


def coverage(engines, hf) -> list[dict]:
    """Each feature: ``enforced``, ``too loose`` (an invalid instance accepted), ``too strict``
    (a valid one refused) or ``refused: <why>`` (the compile raised: a server answers 400)."""
    import torch

    rows = []
    for feature, schema, good, bad in COVERAGE:
        row = {"feature": feature}
        for e in engines:
            try:
                c = e.compile("json", json.dumps(schema))
            except Exception as exc:  # noqa: BLE001 - any compile error is the finding
                row[e.name] = "refused: " + short_error(exc)
                continue
            ok = [e.matches(c, hf.encode(t, add_special_tokens=False)) for t in good + bad]
            loose = any(ok[len(good) :])
            strict = not all(ok[: len(good)])
            row[e.name] = ("too loose" if loose else "") + (" and " if loose and strict else "") + (
                "too strict" if strict else ""
            ) or "enforced"
        rows.append(row)
    row = {"feature": "special tokens kept out (a string's content)"}
    for e in engines:  # <|im_start|> (id 1) is special: it must never be allowed mid-string
        m = e.matcher(e.compile("json", '{"type": "string"}'))
        e.accept(m, hf.convert_tokens_to_ids('"'))
        mask = torch.zeros(-(-len(hf) // 32), dtype=torch.int32)
        e.fill(m, mask)
        row[e.name] = "too loose" if is_allowed(mask, 1) else "enforced"
    rows.append(row)
    return rows


def short_error(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "] /" in text:  # xgrammar prefixes "[time] /path/file.cc:line: "
        text = text.split(": ", 1)[-1]
    return text[:70]


def bench_apply(vocab: int, n: int = 2000) -> dict:
    """Applying one int32 bitmask to a float32 [vocab] logits row, in place, for two masks:
    random bits (the worst case: every element a branch mispredict) and a mask of long runs
    (what grammars give: most tokens in or most tokens out)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    words = -(-vocab // 32)
    masks = {
        "random bits": torch.randint(
            -(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen
        ),
        "runs": torch.where(torch.arange(words) % 256 < 128, -1, 0).to(torch.int32),
    }
    base = torch.randn(vocab, generator=gen)
    logits = torch.empty(vocab)
    fns = {"unpack + masked_fill_ (structured.py)": apply_bitmask}
    try:
        import xgrammar as xgr

        fns["xgrammar.apply_token_bitmask_inplace (cpu kernel)"] = lambda bm, row, v: (
            xgr.apply_token_bitmask_inplace(row, bm, vocab_size=v)
        )
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        for kind, bitmask in masks.items():
            ts = []
            for _ in range(n):
                logits.copy_(base)
                t0 = time.perf_counter_ns()
                fn(bitmask, logits, vocab)
                ts.append(time.perf_counter_ns() - t0)
            out[f"{name}, {kind}"] = pct(ts, 0.5)
    return out


def import_seconds(module: str) -> float:
    # after torch: rlt-hal has always imported it by then
    code = (
        f"import time, torch; t = time.perf_counter(); import {module}; "
        "print(time.perf_counter() - t)"
    )
    return float(subprocess.check_output([sys.executable, "-c", code], text=True))


def machine() -> dict:
    """The project's benchmark machine record (CPU, ISA flags, torch), with the load now."""
    from runtime_glue.bench.engine_bench import machine as bench_machine

    return {**bench_machine(), "load_avg": os.getloadavg(), "python": platform.python_version()}


def versions(names) -> dict:
    out = {}
    for n in ["torch", "transformers", "tokenizers", *names]:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = None
    return out


def table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"{m['processor']}, {m['cpu_count']} cores, flags {' '.join(m['cpu_flags'])}; load average "
        f"{' / '.join(f'{x:.2f}' for x in m['load_avg'])} at start, "
        f"{' / '.join(f'{x:.2f}' for x in result['load_avg_end'])} at end; one thread; "
        f"vocab {result['vocab']}",
        "",
        "| grammar | engine | compile ms | first mask ms | mask µs median | mask µs p90 "
        "| mask µs canonical / walk | accept µs | apply µs | tokens canonical + walk "
        "| refused | masks differ |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in result["rows"]:
        if r["engine"] == "structured.py":
            continue
        lines.append(
            f"| {r['case']} | {r['engine']} | {r['compile_ms']:.1f} | {r['first_mask_ms']:.2f} "
            f"| {r['mask_us_median']:.0f} | {r['mask_us_p90']:.0f} "
            f"| {r['mask_us_canonical_median']:.0f} / {r['mask_us_walk_median']:.0f} "
            f"| {r['accept_us_median']:.0f} | {r['apply_us_median']:.0f} "
            f"| {r['canonical_tokens']} + {r['walk_tokens']} "
            f"| {r['refused_canonical'] + r['refused_walk']} | {r['walk_masks_differ']} |"
        )
    module = [r for r in result["rows"] if r["engine"] == "structured.py"]
    if module:
        lines += [
            "",
            "| grammar | structured.py on llguidance | compile ms | allowed() µs median / p90 "
            "| apply() µs (mask included) | accept() µs | tokens |",
            "|---|---|--:|--:|--:|--:|--:|",
        ]
        for r in module:
            lines.append(
                f"| {r['case']} | Matcher | {r['compile_ms']:.1f} "
                f"| {r['allowed_us_median']:.0f} / {r['allowed_us_p90']:.0f} "
                f"| {r['apply_with_mask_us_median']:.0f} | {r['accept_us_median']:.0f} "
                f"| {r['tokens']} |"
            )
    lines += ["", "| apply a bitmask to a float32 [vocab] row | µs median |", "|---|--:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in result["apply_us"].items()]
    names = [k for k in result["coverage"][0] if k != "feature"]
    lines += ["", f"| JSON Schema feature | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for r in result["coverage"]:
        lines.append(f"| {r['feature']} | {' | '.join(r[n] for n in names)} |")
    lines += ["", "| engine | tokenizer setup s | import s (after torch) |", "|---|--:|--:|"]
    for name, s in result["setup_s"].items():
        lines.append(f"| {name} | {s:.2f} | {result['import_s'][name]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="xgrammar,llguidance")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--reps", type=int, default=5, help="cold compiles per grammar")
    ap.add_argument("--walks", type=int, default=8, help="random walks per grammar")
    ap.add_argument("--max-walk", type=int, default=200, help="tokens per random walk at most")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    load_start = machine()
    t0 = time.perf_counter()
    hf = build_tokenizer(args.vocab)
    train_s = time.perf_counter() - t0
    kinds = {"xgrammar": Xgrammar, "llguidance": Llguidance}
    engines, setup = [], {}
    for name in args.engines.split(","):
        importlib.import_module(name)  # import time is measured apart, in a fresh process
        t0 = time.perf_counter()
        engines.append(kinds[name](hf, args.vocab))
        setup[name] = time.perf_counter() - t0
    rows = []
    for case in args.cases.split(","):
        rows += bench_case(engines, case, hf, args.vocab, args.reps, args.walks, args.max_walk)
    result = {
        "machine": load_start,
        "versions": versions([e.name for e in engines]),
        "vocab": args.vocab,
        "tokenizer_train_s": train_s,
        "setup_s": setup,
        "import_s": {e.name: import_seconds(e.name) for e in engines},
        "apply_us": bench_apply(args.vocab),
        "coverage": coverage(engines, hf),
        "rows": rows,
        "load_avg_end": os.getloadavg(),
    }
    print(table(result))
    print(f"\nversions: {result['versions']}; tokenizer trained in {train_s:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
