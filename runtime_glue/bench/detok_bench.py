"""``rlt-hal bench detokenize``: what turning tokens into text costs the engine thread per
token, as the output grows, against decoding the whole output again after every token (what
the engine did before), measured in the same run."""

from __future__ import annotations

import statistics
import time

import torch

from runtime_glue.engine.detokenizer import IncrementalDetokenizer


def _per_token_seconds(run, n: int, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def detokenize(tokenizer, lengths: list[int], runs: int, stop: tuple[str, ...] = ("\n\n\n",)):
    """Per-token time of the incremental detokenizer and of full decoding, at each length."""
    vocab = len(tokenizer)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (max(lengths),), generator=gen).tolist()
    results = []
    for n in sorted(lengths):

        def incremental(n=n):
            detok = IncrementalDetokenizer(tokenizer, stop)
            for token in ids[:n]:
                detok.add(token)

        def full(n=n):  # decode everything and scan it for the stop strings, every token
            for k in range(1, n + 1):
                text = tokenizer.decode(ids[:k], skip_special_tokens=True)
                any(s in text for s in stop)

        inc = _per_token_seconds(incremental, n, runs)
        old = _per_token_seconds(full, n, max(1, runs // 2))
        results.append(
            {"tokens": n, "incremental_s_per_token": inc, "full_decode_s_per_token": old}
        )
    first, last = results[0], results[-1]
    return {
        "runs": runs,
        "stop": list(stop),
        "results": results,
        "incremental_growth": last["incremental_s_per_token"] / first["incremental_s_per_token"],
        "full_decode_growth": last["full_decode_s_per_token"] / first["full_decode_s_per_token"],
    }


def markdown_detokenize(report: dict) -> str:
    lines = [
        "| output tokens | incremental (us/token) | full decode (us/token) | full / incremental |",
        "|---|---|---|---|",
    ]
    for r in report["results"]:
        inc, old = r["incremental_s_per_token"], r["full_decode_s_per_token"]
        lines.append(f"| {r['tokens']} | {inc * 1e6:.2f} | {old * 1e6:.2f} | {old / inc:.1f} |")
    lines.append(
        f"\nper-token cost, longest over shortest output: incremental "
        f"{report['incremental_growth']:.2f}x, full decode {report['full_decode_growth']:.2f}x"
    )
    return "\n".join(lines)
