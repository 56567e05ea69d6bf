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


def _tokens(i: int, n: int) -> list[int]:
    """``n`` token ids, distinct for each ``i`` (ids 3..902 exist in every preset)."""
    return [3 + (i * 31 + j * 7) % 900 for j in range(n)]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int, **extra
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens, text = 0, []
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
                text.append(chunk["choices"][0]["text"])
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
        "text": "".join(text),
    }


async def _run(
    url: str, model: str, concurrency: int, jobs: list[tuple[list[int], dict]], output_len: int
) -> tuple[list[dict], float]:
    """Send ``jobs`` (prompt, extra body fields), at most ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def bounded(prompt, extra):
            async with sem:
                try:
                    return await _one(client, url, model, prompt, output_len, **extra)
                except httpx.HTTPError as exc:
                    return {"error": f"{type(exc).__name__}: {exc}"}

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p, e) for p, e in jobs))
        return results, time.perf_counter() - start


def _summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    itl = [x for r in ok for x in r["itl"]]
    return {
        "num_requests": len(results),
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


def _level(url, model, concurrency, num_requests, input_len, output_len) -> dict:
    jobs: list[tuple[list[int], dict]] = [(_tokens(i, input_len), {}) for i in range(num_requests)]
    results, wall = asyncio.run(_run(url, model, concurrency, jobs, output_len))
    return {"concurrency": concurrency, **_summary(results, wall)}


def _shared_prefix_level(
    url, model, concurrency, num_requests, prefix_len, input_len, output_len, run_id
) -> dict:
    """The same requests twice: each with a cache salt of its own (no request finds another's
    blocks: what caching off computes, the baseline), then all with one salt (they share the
    prefix). Each pass starts with one request alone that fills the cache for its salt."""
    prefix = _tokens(10_000, prefix_len)
    prompts = [prefix + _tokens(i, input_len) for i in range(num_requests + 1)]
    level, texts = {"concurrency": concurrency}, {}
    for name in ("unshared", "shared"):
        salt = f"{run_id}-c{concurrency}-{name}"
        jobs = [
            (p, {"cache_salt": f"{salt}-{i}" if name == "unshared" else salt})
            for i, p in enumerate(prompts)
        ]
        first, _ = asyncio.run(_run(url, model, 1, jobs[:1], output_len))
        results, wall = asyncio.run(_run(url, model, concurrency, jobs[1:], output_len))
        level[name] = {"first_request_ttft_s": first[0].get("ttft"), **_summary(results, wall)}
        texts[name] = [r.get("text") for r in first + results]
    base, shared = (level[n]["ttft_s"]["p50"] for n in ("unshared", "shared"))
    level["ttft_p50_ratio"] = base / shared if base and shared else None
    level["identical_outputs"] = texts["unshared"] == texts["shared"]
    return level


def _served_model(url: str, model: str | None) -> str:
    """``model``, or the server's first, after asking its /v1/models: a URL without a scheme,
    no server there or a model it does not serve is a one-line error."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url!r} has no scheme: give it as http://HOST:PORT/v1")
    try:
        r = httpx.get(url + "/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise ValueError(
            f"--url {url}: no OpenAI-compatible server answers there ({type(exc).__name__}: "
            f"{exc}); start one (rlt-hal serve) or check the host and port"
        ) from exc
    if r.status_code != 200:
        raise ValueError(f"--url {url}: GET /v1/models answered HTTP {r.status_code}")
    served = [m["id"] for m in r.json().get("data", [])]
    if model is None:
        if not served:
            raise ValueError(f"--url {url}: the server lists no models")
        return served[0]
    if model not in served:
        raise ValueError(f"--model {model!r}: the server at {url} serves {', '.join(served)}")
    return model


def failed_everywhere(report: dict) -> bool:
    """Whether every request of every level failed (the bench then exits non-zero)."""
    levels = [
        part
        for lv in report["levels"]
        for part in ((lv["unshared"], lv["shared"]) if "shared" in lv else (lv,))
    ]
    return all(part["errors"] == part["num_requests"] for part in levels)


def serve(
    url: str,
    concurrency: list[int],
    num_requests: int,
    input_len: int,
    output_len: int,
    model: str | None = None,
    shared_prefix_len: int = 0,
) -> dict:
    """Each concurrency level's figures; with ``shared_prefix_len`` P, every prompt is one P-token
    prefix followed by ``input_len`` tokens of its own, sent without and with sharing."""
    url = url.rstrip("/").removesuffix("/v1")
    model = _served_model(url, model)
    run_id = f"bench-{time.time_ns()}"  # no cache entry of an earlier run is ever hit
    levels = [
        _shared_prefix_level(
            url, model, c, num_requests, shared_prefix_len, input_len, output_len, run_id
        )
        if shared_prefix_len
        else _level(url, model, c, num_requests, input_len, output_len)
        for c in concurrency
    ]
    return {
        "url": url,
        "model": model,
        "input_len": input_len,
        "output_len": output_len,
        "shared_prefix_len": shared_prefix_len,
        "levels": levels,
    }


def markdown_serve(report: dict) -> str:
    shared = bool(report.get("shared_prefix_len"))
    lines = [
        ("| concurrency | prefix | " if shared else "| concurrency | ")
        + "requests | errors | TTFT p50/p99 (s) | TPOT p50/p99 (s) | ITL p50/p99 (s) | req/s | "
        "output tok/s |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if shared else ""),
    ]
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731

    def row(label: str, lv: dict) -> str:
        return (
            f"| {label} | {lv['num_requests']} | {lv['errors']} | "
            f"{f(lv['ttft_s']['p50'])}/{f(lv['ttft_s']['p99'])} | "
            f"{f(lv['tpot_s']['p50'])}/{f(lv['tpot_s']['p99'])} | "
            f"{f(lv['itl_s']['p50'])}/{f(lv['itl_s']['p99'])} | "
            f"{lv['request_throughput_per_s']:.3f} | {lv['output_tok_s']:.2f} |"
        )

    notes = []
    for lv in report["levels"]:
        c = lv["concurrency"]
        if not shared:
            lines.append(row(str(c), lv))
            continue
        lines.append(row(f"{c} | own salt each (baseline)", lv["unshared"]))
        lines.append(row(f"{c} | shared", lv["shared"]))
        notes.append(
            f"c={c}: TTFT p50 {f(lv['ttft_p50_ratio'])}x lower with the prefix shared; "
            f"outputs {'identical' if lv['identical_outputs'] else 'DIFFERENT'}"
        )
    return "\n".join(lines + notes)
