"""The benchmark commands run on the tiny preset and write well-formed JSON with every field.
(Timing targets live in the benchmarks and docs/benchmarks.md, never in tests.)"""

from __future__ import annotations

import json
import os

from tests.helpers import rlt_hal
from tests.server_helpers import ServerProcess


def _bench(tmp_path, command: str, *extra: str):
    """Run ``rlt-hal bench COMMAND EXTRA... --json OUT``; returns (report, printed table)."""
    args = [*command.split(), *extra]
    out = tmp_path / "report.json"
    env = {**os.environ, "RLT_HAL_CACHE": str(tmp_path / "cache")}
    proc = rlt_hal("bench", *args, "--json", str(out), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def _positive(x):
    return isinstance(x, (int, float)) and x > 0


def test_bench_latency_reports_figures_floors_and_ratios(tmp_path):
    report, table = _bench(
        tmp_path,
        "latency --preset tiny --input-lens 8,20 --output-len 4 --runs 2 --warmup 1 --block-size 16",
    )
    assert report["command"].startswith("rlt-hal bench latency")
    assert _positive(report["floors"]["bandwidth"]["read_Bps"])
    assert set(report["floors"]["gemm_flops"]) == {"1", "8", "20"}
    assert report["kv_pool"]["tokens"] >= 24 and _positive(report["kv_pool"]["bytes_per_token"])
    overhead = report["python_overhead"]
    assert overhead["decode_step_wall_s"] > 0 and _positive(overhead["kernel_self_time_s"])
    assert overhead["overhead_s"] == max(
        overhead["decode_step_wall_s"] - overhead["kernel_self_time_s"], 0.0
    )
    assert _positive(report["peak_memory"]["peak_rss_bytes"])
    assert report["machine"]["torch"] and report["device"] == "cpu"
    # The cpu default plan; the GEMM rate (the prefill floor) uses its prompt rows' kernel.
    assert report["mode"] == "deterministic" and report["plan"].startswith("deterministic mode")
    assert f"gate_up_proj {report['floors']['gemm_kernel']}" in report["plan"]
    assert [r["input_len"] for r in report["results"]] == [8, 20]
    for r in report["results"]:
        for key in ("ttft_s", "tpot_s", "output_tok_s"):
            assert r[key]["min"] <= r[key]["p50"] <= r[key]["max"] and _positive(r[key]["p50"])
        for key in (
            "decode_floor_s",
            "tpot_over_decode_floor",
            "prefill_floor_s",
            "ttft_over_prefill_floor",
            "prefill_fraction_of_gemm_rate",
        ):
            assert _positive(r[key]), key
    assert "| 8 |" in table and "TPOT/floor" in table


def test_bench_baseline_compares_with_the_hf_module_reference(tmp_path):
    report, table = _bench(
        tmp_path,
        "baseline --preset tiny --input-len 8 --output-len 3 --runs 1 --concurrency 3 --block-size 16",
    )
    assert set(report["levels"]) == {"c1", "c3"}
    for level in report["levels"].values():
        assert _positive(level["rlt_hal_tok_s"]) and _positive(level["baseline_tok_s"])
        assert abs(level["ratio"] - level["rlt_hal_tok_s"] / level["baseline_tok_s"]) < 1e-9
    assert "HF-module reference" in report["baseline"]
    assert report["mode"] == "deterministic" and report["plan"].startswith("deterministic mode")
    assert "| c3 |" in table


def test_bench_serve_drives_a_real_server_with_zero_errors(tmp_path, tiny_ckpt):
    server = ServerProcess(tiny_ckpt)
    try:
        report, table = _bench(
            tmp_path,
            "serve --concurrency 1,4 --num-requests 6 --input-len 8 --output-len 5",
            "--url",
            server.base + "/v1",
        )
    finally:
        server.stop()
    assert report["model"] == "toy" and [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for lv in report["levels"]:
        assert lv["errors"] == 0 and lv["num_requests"] == 6
        for key in ("ttft_s", "tpot_s", "itl_s"):
            assert _positive(lv[key]["p50"]) and lv[key]["p99"] >= lv[key]["p50"]
        assert _positive(lv["request_throughput_per_s"]) and _positive(lv["output_tok_s"])
    assert "| 4 | 6 | 0 |" in table


def test_bench_determinism_reports_the_cost_of_the_mode(tmp_path):
    report, table = _bench(
        tmp_path,
        "determinism --preset tiny --input-len 8 --output-len 3 --runs 1 --concurrency 2 --block-size 16",
    )
    assert set(report["levels"]) == {"c1", "c2"}
    for r in report["levels"].values():
        assert _positive(r["off_tok_s"]) and _positive(r["on_tok_s"])
        assert abs(r["cost"] - (1 - r["on_tok_s"] / r["off_tok_s"])) < 1e-9
    assert "| c2 |" in table


def test_bench_plans_compares_the_default_with_every_single_kernel_plan(tmp_path):
    report, table = _bench(
        tmp_path,
        "plans --preset tiny --input-len 8 --output-len 3 --runs 1 --concurrency 2 --block-size 16",
    )
    plans = report["plans"]
    assert {"default", "deterministic, torch only", "hf-exact (torch)"} <= set(plans)
    assert plans["hf-exact (torch)"]["mode"] == "hf-exact"
    for name, r in plans.items():
        assert r["mode"] == "hf-exact" or r["plan"].startswith("deterministic mode"), name
        for key in ("ttft_over_best", "tpot_over_best", "c2_best_over_this"):
            assert r[key] >= 1.0, (name, key)
        assert f"| {name} | {r['mode']} | {r['ttft_s']:.3f} |" in table
    for key in ("ttft_over_best", "tpot_over_best", "c2_best_over_this"):
        assert min(r[key] for r in plans.values()) == 1.0  # one plan is the best at each
