"""``rlt-hal bench latency`` and ``bench baseline``: single-request figures with their floors,
and rlt-hal against the HF-module reference on the same weights, in the same process."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch

from runtime_glue.bench import floors
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams


def summary(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "min": min(values), "max": max(values)}


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict:
    """Where a figure was measured, with the CPU flags that decide which kernels are fastest."""
    from runtime_glue.ouro.plan_record import machine_fingerprint

    fingerprint = machine_fingerprint()
    flags = set(fingerprint.get("flags", "").split())
    return {
        "platform": platform.platform(),
        "processor": fingerprint.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": [f for f in ISA_FLAGS if f in flags],
        "torch_capability": fingerprint["torch_capability"],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _one_run(llm: LLM, prompt: list[int], output_len: int) -> dict:
    eng = llm.engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    eng.add_request("bench", prompt, params)
    first = None
    while eng.has_unfinished():
        if eng.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {
        "ttft": first - start,
        "tpot": (end - first) / max(output_len - 1, 1),
        "tok_s": output_len / (end - start),
    }


# kineto (torch.profiler's tracer) logs "USDT: ... profiler_start" and "profiler_stop" on
# standard error at a level above ERROR (5), so its default threshold never hides them: only a
# threshold past it does. It reads KINETO_LOG_LEVEL when the first profile starts.
KINETO_QUIET = "6"


def quiet_profile() -> torch.profiler.profile:
    """``torch.profiler.profile()`` without kineto's lines on standard error (a
    ``KINETO_LOG_LEVEL`` the user set is kept)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
    return torch.profiler.profile()


def python_overhead(llm: LLM, prompt: list[int]) -> dict:
    """Wall time of one decode step against the time its kernels ran (torch.profiler): every
    dispatcher op, aten's and the drivers' custom ops alike (``namespace::name``). The profiled
    step runs per op (the bound decode loop steps aside while a profiler listens, as it calls
    no op by name): ``bound_step_wall_s`` is the step before it, as served (None where the
    model has no bound loop)."""
    eng = llm.engine
    eng.add_request("overhead", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # prefill
    start = time.perf_counter()
    eng.step()  # one decode step, unprofiled
    unprofiled = time.perf_counter() - start
    with quiet_profile() as prof:
        start = time.perf_counter()
        eng.step()  # one decode step
        wall = time.perf_counter() - start
    while eng.has_unfinished():
        eng.step()
    kernels = sum(e.self_cpu_time_total for e in prof.key_averages() if "::" in e.key) / 1e6
    return {
        "decode_step_wall_s": wall,
        "kernel_self_time_s": kernels,
        "overhead_s": max(wall - kernels, 0.0),
        "bound_step_wall_s": unprofiled if llm.model.bound is not None else None,
    }


def measure_floors(llm: LLM, rows: list[int]) -> dict:
    """Read bandwidth (the best of a copy, a sum and the plan's decode projection kernel on a
    large weight of the model's scheme), and the GEMM rate of the kernel the plan runs prompt
    rows through."""
    from hal.quant import QuantizedWeight

    dev, sync = llm.driver.device.torch_device, llm.driver.device.synchronize
    linear = llm.model.kernels.rows["prompt"]["gate_up_proj"]
    decode = llm.model.kernels.rows["generated"]["gate_up_proj"]
    w = llm.weights["model.layers.0.mlp.gate_up_proj.weight"]
    quantized = (w.scheme, w.group_size) if isinstance(w, QuantizedWeight) else None
    scheme = "bf16" if quantized is None else quantized[0]
    return {
        "bandwidth": floors.read_bandwidth(dev, sync, decode_linear=decode, scheme=scheme),
        "decode_kernel": llm.plan.choice("generated", "gate_up_proj").kernel,
        "gemm_kernel": llm.plan.choice("prompt", "gate_up_proj").kernel,
        "gemm_flops": {
            r: floors.gemm_rate(dev, sync, r, linear=linear, quantized=quantized)
            for r in sorted(set(rows))
        },
    }


def latency(llm: LLM, input_lens: list[int], output_len: int, runs: int, warmup: int) -> dict:
    cfg = llm.config
    hw = measure_floors(llm, [*input_lens, 1])
    results = []
    for n in input_lens:
        prompt = _prompt(n, cfg.vocab_size, seed=n)
        for _ in range(warmup):
            _one_run(llm, prompt, min(output_len, 4))
        samples = [_one_run(llm, prompt, output_len) for _ in range(runs)]
        ttft = summary([s["ttft"] for s in samples])
        tpot = summary([s["tpot"] for s in samples])
        context = n + output_len // 2
        decode_floor = floors.decode_bytes(cfg, context, llm.weights) / hw["bandwidth"]["read_Bps"]
        prefill_floor = floors.prefill_flops(cfg, n) / hw["gemm_flops"][n]
        results.append(
            {
                "input_len": n,
                "output_len": output_len,
                "runs": runs,
                "ttft_s": ttft,
                "tpot_s": tpot,
                "output_tok_s": summary([s["tok_s"] for s in samples]),
                "decode_floor_s": decode_floor,
                "tpot_over_decode_floor": tpot["p50"] / decode_floor,
                "prefill_floor_s": prefill_floor,
                "ttft_over_prefill_floor": ttft["p50"] / prefill_floor,
                "prefill_fraction_of_gemm_rate": prefill_floor / ttft["p50"],
            }
        )
    lay = llm.kv_layout
    return {
        "machine": machine(),
        "device": llm.driver.label,
        "attention_backend": llm.model.backend.name,
        "mode": llm.plan.mode,
        "plan": llm.plan.describe(),
        "weights": {
            "scheme": llm.plan.quantization,
            "bytes_per_token": floors.weight_bytes_per_token(cfg, llm.weights),
        },
        "config": {
            "hidden_size": cfg.hidden_size,
            "layers": cfg.num_hidden_layers,
            "loops": cfg.total_ut_steps,
            "vocab_size": cfg.vocab_size,
        },
        "floors": hw,
        "kv_pool": {
            "blocks": lay.num_blocks,
            "tokens": lay.num_slots,
            "bytes_per_token": lay.bytes_per_token,
        },
        "peak_memory": llm.driver.device.memory_stats(),
        "python_overhead": python_overhead(llm, _prompt(input_lens[0], cfg.vocab_size, 1)),
        "results": results,
    }


def baseline(llm: LLM, input_len: int, output_len: int, runs: int, concurrency: int) -> dict:
    """rlt-hal vs the HF-module reference on the same weights: c=1 and ``concurrency`` prompts."""
    from runtime_glue.checks.reference import OuroReference
    from runtime_glue.ouro.quantize import dequantized

    ref = OuroReference(llm.config).load(llm.model_dir, dequantized(llm.weights))
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    prompts = [_prompt(input_len, vocab, seed=i) for i in range(concurrency)]

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    batch = f"c{concurrency}"
    rows: dict[str, dict[str, list[float]]] = {
        "c1": {"rlt_hal": [], "baseline": []},
        batch: {"rlt_hal": [], "baseline": []},
    }
    for _ in range(runs):  # interleaved, so drift on a shared machine hits both alike
        rows["c1"]["rlt_hal"].append(output_len / timed(lambda: llm.generate(prompts[:1], params)))
        rows["c1"]["baseline"].append(
            output_len / timed(lambda: ref.generate(prompts[0], output_len))
        )
        total = output_len * concurrency
        rows[batch]["rlt_hal"].append(total / timed(lambda: llm.generate(prompts, params)))
        rows[batch]["baseline"].append(
            total / timed(lambda: [ref.generate(p, output_len) for p in prompts])
        )
    out: dict[str, Any] = {
        "machine": machine(),
        "device": llm.driver.label,
        "mode": llm.plan.mode,
        "plan": llm.plan.describe(),
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "concurrency": concurrency,
        "baseline": "HF-module reference (transformers Llama blocks + DynamicCache, eager); "
        "it runs one request at a time, so its batched figure is sequential runs",
    }
    out["levels"] = {}
    for level, pair in rows.items():
        ours, theirs = statistics.median(pair["rlt_hal"]), statistics.median(pair["baseline"])
        out["levels"][level] = {
            "rlt_hal_tok_s": ours,
            "baseline_tok_s": theirs,
            "ratio": ours / theirs,
        }
    return out


def markdown_latency(report: dict) -> str:
    lines = [
        "| input | TTFT p50 (s) | TPOT p50 (s) | tok/s p50 | decode floor (s) | "
        "TPOT/floor | prefill floor (s) | TTFT/floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['input_len']} | {r['ttft_s']['p50']:.3f} | {r['tpot_s']['p50']:.3f} | "
            f"{r['output_tok_s']['p50']:.2f} | {r['decode_floor_s']:.3g} | "
            f"{r['tpot_over_decode_floor']:.2f} | {r['prefill_floor_s']:.3g} | "
            f"{r['ttft_over_prefill_floor']:.2f} |"
        )
    weights, bw = report["weights"], report["floors"]["bandwidth"]
    lines.append(
        f"\nweights: {weights['scheme']}, {weights['bytes_per_token'] / 2**30:.3f} GiB read per "
        f"token; floor bandwidth {bw['read_Bps'] / 1e9:.1f} GB/s (copy "
        f"{bw['copy_Bps'] / 1e9:.1f}, sum {bw['sum_read_Bps'] / 1e9:.1f}, decode kernel "
        f"{bw.get('kernel_read_Bps', 0) / 1e9:.1f})"
    )
    return "\n".join(lines)


def markdown_baseline(report: dict) -> str:
    lines = ["| concurrency | rlt-hal tok/s | baseline tok/s | ratio |", "|---|---|---|---|"]
    for level, r in report["levels"].items():
        lines.append(
            f"| {level} | {r['rlt_hal_tok_s']:.2f} | {r['baseline_tok_s']:.2f} | {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def determinism_cost(
    default: LLM, deterministic: LLM, input_len: int, output_len: int, runs: int, concurrency: int
) -> dict:
    """Throughput with deterministic mode off and on, interleaved run by run."""
    vocab = default.config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    prompts = [_prompt(input_len, vocab, seed=i) for i in range(concurrency)]
    levels = {"c1": prompts[:1], f"c{concurrency}": prompts}
    samples: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in levels}
    for _ in range(runs):
        for level, batch in levels.items():
            for mode, llm in (("off", default), ("on", deterministic)):
                start = time.perf_counter()
                llm.generate(batch, params)
                samples[level][mode].append(output_len * len(batch) / (time.perf_counter() - start))
    out: dict[str, Any] = {
        "machine": machine(),
        "device": default.driver.label,
        "plans": {
            "mode off": {"plan": default.plan.describe()},
            "mode on": {"plan": deterministic.plan.describe()},
        },
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "levels": {},
    }
    for level, pair in samples.items():
        off, on = statistics.median(pair["off"]), statistics.median(pair["on"])
        out["levels"][level] = {"off_tok_s": off, "on_tok_s": on, "cost": 1 - on / off}
    return out


def markdown_determinism(report: dict) -> str:
    lines = ["| concurrency | mode off tok/s | mode on tok/s | cost |", "|---|---|---|---|"]
    for level, r in report["levels"].items():
        lines.append(
            f"| {level} | {r['off_tok_s']:.2f} | {r['on_tok_s']:.2f} | {100 * r['cost']:.1f}% |"
        )
    return "\n".join(lines)


def compare_plans(
    llm: LLM, variants: dict[str, LLM], input_len: int, output_len: int, runs: int, concurrency: int
) -> dict:
    """TTFT and TPOT of one request and throughput of ``concurrency`` requests under each plan,
    runs interleaved, each figure also as a ratio to the best plan's."""
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    prompts = [_prompt(input_len, vocab, seed=i) for i in range(concurrency)]
    samples: dict[str, dict[str, list[float]]] = {
        name: {"ttft": [], "tpot": [], "tok_s": []} for name in variants
    }
    for _ in range(runs):
        for name, v in variants.items():
            one = _one_run(v, prompts[0], output_len)
            samples[name]["ttft"].append(one["ttft"])
            samples[name]["tpot"].append(one["tpot"])
            start = time.perf_counter()
            v.generate(prompts, params)
            samples[name]["tok_s"].append(concurrency * output_len / (time.perf_counter() - start))
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    best = {
        "ttft": min(m["ttft"] for m in med.values()),
        "tpot": min(m["tpot"] for m in med.values()),
        "tok_s": max(m["tok_s"] for m in med.values()),
    }
    plans = {}
    for name, v in variants.items():
        m = med[name]
        plans[name] = {
            "plan": v.plan.describe(),
            "mode": v.plan.mode,
            "ttft_s": m["ttft"],
            "tpot_s": m["tpot"],
            f"c{concurrency}_tok_s": m["tok_s"],
            "ttft_over_best": m["ttft"] / best["ttft"],
            "tpot_over_best": m["tpot"] / best["tpot"],
            f"c{concurrency}_best_over_this": best["tok_s"] / m["tok_s"],
        }
    return {
        "machine": machine(),
        "device": llm.driver.label,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "concurrency": concurrency,
        "plans": plans,
    }


def markdown_plans(report: dict) -> str:
    c = report["concurrency"]
    lines = [
        f"| plan | mode | TTFT p50 (s) | x best | TPOT p50 (s) | x best | c={c} tok/s | x best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["plans"].items():
        lines.append(
            f"| {name} | {r['mode']} | {r['ttft_s']:.3f} | {r['ttft_over_best']:.2f} | "
            f"{r['tpot_s']:.3f} | {r['tpot_over_best']:.2f} | {r[f'c{c}_tok_s']:.2f} | "
            f"{r[f'c{c}_best_over_this']:.2f} |"
        )
    return "\n".join(lines)
