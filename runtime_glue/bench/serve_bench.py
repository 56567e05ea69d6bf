"""``rlt-hal bench serve``: streaming HTTP load through the OpenAI API at several concurrencies."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, input_len: int, output_len: int, i: int
) -> dict:
    prompt = [3 + (i * 31 + j * 7) % 900 for j in range(input_len)]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    if tokens != output_len or not stamps:
        return {"error": f"expected {output_len} tokens, got {tokens}"}
    itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "ttft": stamps[0] - start,
        "tpot": (end - stamps[0]) / max(tokens - 1, 1),
        "itl": itl,
        "tokens": tokens,
        "latency": end - start,
    }


async def _level(
    url: str, model: str, concurrency: int, num_requests: int, input_len: int, output_len: int
) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def bounded(i):
            async with sem:
                try:
                    return await _one(client, url, model, input_len, output_len, i)
                except httpx.HTTPError as exc:
                    return {"error": f"{type(exc).__name__}: {exc}"}

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(num_requests)))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    itl = [x for r in ok for x in r["itl"]]
    return {
        "concurrency": concurrency,
        "num_requests": num_requests,
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "ttft_s": {
            "p50": _pct([r["ttft"] for r in ok], 0.5),
            "p99": _pct([r["ttft"] for r in ok], 0.99),
        },
        "tpot_s": {
            "p50": _pct([r["tpot"] for r in ok], 0.5),
            "p99": _pct([r["tpot"] for r in ok], 0.99),
        },
        "itl_s": {"p50": _pct(itl, 0.5), "p99": _pct(itl, 0.99)},
        "request_throughput_per_s": len(ok) / wall,
        "output_tok_s": sum(r["tokens"] for r in ok) / wall,
        "mean_latency_s": statistics.mean(r["latency"] for r in ok) if ok else None,
    }


def serve(
    url: str,
    concurrency: list[int],
    num_requests: int,
    input_len: int,
    output_len: int,
    model: str | None = None,
) -> dict:
    url = url.rstrip("/").removesuffix("/v1")
    model = model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
    levels = [
        asyncio.run(_level(url, model, c, num_requests, input_len, output_len)) for c in concurrency
    ]
    return {
        "url": url,
        "model": model,
        "input_len": input_len,
        "output_len": output_len,
        "levels": levels,
    }


def markdown_serve(report: dict) -> str:
    lines = [
        "| concurrency | requests | errors | TTFT p50/p99 (s) | TPOT p50/p99 (s) | "
        "ITL p50/p99 (s) | req/s | output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for lv in report["levels"]:
        lines.append(
            f"| {lv['concurrency']} | {lv['num_requests']} | {lv['errors']} | "
            f"{f(lv['ttft_s']['p50'])}/{f(lv['ttft_s']['p99'])} | "
            f"{f(lv['tpot_s']['p50'])}/{f(lv['tpot_s']['p99'])} | "
            f"{f(lv['itl_s']['p50'])}/{f(lv['itl_s']['p99'])} | "
            f"{lv['request_throughput_per_s']:.3f} | {lv['output_tok_s']:.2f} |"
        )
    return "\n".join(lines)
