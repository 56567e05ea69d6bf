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
    assert "USDT" not in proc.stderr  # kineto's profiler_start/stop lines, silenced
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
    assert _positive(overhead["kernel_self_time_s"])
    assert 0 <= overhead["overhead_s"] < overhead["decode_step_wall_s"]
    # The profiled step ran per op; the step before it as served (a bound loop where the plan
    # binds a kernel, else None).
    assert overhead["bound_step_wall_s"] is None or _positive(overhead["bound_step_wall_s"])
    assert _positive(report["peak_memory"]["peak_rss_bytes"])
    assert report["machine"]["torch"] and report["device"] == "cpu"
    # The cpu default plan; the GEMM rate (the prefill floor) uses its prompt rows' kernel.
    assert report["mode"] == "deterministic" and report["plan"].startswith("deterministic mode")
    assert f"gate_up_proj {report['floors']['gemm_kernel']}" in report["plan"]
    assert table.startswith(f"plan: {report['plan']}\n")  # the table names the plan it ran
    assert [r["input_len"] for r in report["results"]] == [8, 20]
    for r in report["results"]:
        for key in ("ttft_s", "tpot_s", "output_tok_s"):
            assert r[key]["min"] <= r[key]["p50"] <= r[key]["max"] and _positive(r[key]["p50"])
        for key in ("decode_floor_s", "prefill_floor_s", "prefill_fraction_of_gemm_rate"):
            assert _positive(r[key]), key
        # The printed table shows the JSON's own figures.
        row = f"| {r['input_len']} | {r['ttft_s']['p50']:.3f} | {r['tpot_s']['p50']:.3f} |"
        assert row in table and f"{r['tpot_over_decode_floor']:.2f} |" in table
        # a floor of microseconds shows its digits, not 0.000
        assert f"| {r['decode_floor_s']:.3g} |" in table and "| 0.000 |" not in table


def test_bench_baseline_compares_with_the_hf_module_reference(tmp_path):
    report, table = _bench(
        tmp_path,
        "baseline --preset tiny --input-len 8 --output-len 3 --runs 1 --concurrency 3 --block-size 16",
    )
    assert set(report["levels"]) == {"c1", "c3"}
    for name, level in report["levels"].items():
        assert _positive(level["rlt_hal_tok_s"]) and _positive(level["baseline_tok_s"])
        assert (
            f"| {name} | {level['rlt_hal_tok_s']:.2f} | {level['baseline_tok_s']:.2f} | " in table
        )
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
    assert table.startswith("plan: the server's (its start-up lines name it)\n")


def test_bench_serve_names_a_model_the_server_lacks_and_fails_when_every_request_does(
    tiny_ckpt, capsys
):
    from runtime_glue.cli.main import main

    server = ServerProcess(tiny_ckpt)
    base = ["bench", "serve", "--url", server.base + "/v1", "--num-requests", "2"]
    try:
        assert main([*base, "--model", "foo"]) == 2
        assert "--model 'foo': the server at" in capsys.readouterr().err
        assert main([*base, "--input-len", "100000", "--output-len", "2"]) == 1  # all 400s
    finally:
        server.stop()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rlt-hal: error: every request failed (e.g. HTTP 400")


def test_bench_serve_shared_prefix_runs_unshared_then_shared(tmp_path, tiny_ckpt):
    server = ServerProcess(tiny_ckpt)
    try:
        report, table = _bench(
            tmp_path,
            "serve --concurrency 2 --num-requests 4 --input-len 5 --output-len 4 "
            "--shared-prefix-len 64",
            "--url",
            server.base,
        )
        hits = server.metrics()["rlt_hal_prefix_cache_hits_total"]
    finally:
        server.stop()
    [lv] = report["levels"]
    assert report["shared_prefix_len"] == 64 and lv["identical_outputs"] is True
    for name in ("unshared", "shared"):
        assert lv[name]["errors"] == 0 and lv[name]["num_requests"] == 4
        assert _positive(lv[name]["first_request_ttft_s"])
    # Only the shared pass hits: its four requests after the first, the whole prefix each.
    assert hits == 4 * 64
    assert lv["ttft_p50_ratio"] == lv["unshared"]["ttft_s"]["p50"] / lv["shared"]["ttft_s"]["p50"]
    assert "| 2 | own salt each (baseline) | 4 | 0 |" in table and "| 2 | shared | 4 | 0 |" in table
    assert f"c=2: TTFT p50 {lv['ttft_p50_ratio']:.3f}x lower" in table


def test_bench_determinism_reports_the_cost_of_the_mode(tmp_path):
    report, table = _bench(
        tmp_path,
        "determinism --preset tiny --input-len 8 --output-len 3 --runs 1 --concurrency 2 --block-size 16",
    )
    assert set(report["levels"]) == {"c1", "c2"}
    assert "plan (mode on): deterministic mode" in table and "plan (mode off): " in table
    for name, r in report["levels"].items():
        assert _positive(r["off_tok_s"]) and _positive(r["on_tok_s"])
        assert f"| {name} | {r['off_tok_s']:.2f} | {r['on_tok_s']:.2f} | " in table


def test_bench_adaptive_compares_full_depth_adaptive_depth_and_depth_wise_batching(tmp_path):
    report, table = _bench(
        tmp_path,
        "adaptive --preset tiny --input-len 8 --output-len 4 --runs 1 --concurrency 1,3,5 "
        "--block-size 16 --exit-threshold 0.5",
    )
    assert set(report["levels"]) == {"c1", "c3", "c5"}
    assert report["depth_equals_adaptive"] is True  # the same bits, only scheduled otherwise
    assert 1 <= report["mean_loops_adaptive"] < report["loops"]
    for name, r in report["levels"].items():
        assert _positive(r["full_tok_s"]) and _positive(r["depth_tok_s"])
        assert f"| {name} | {r['full_tok_s']:.2f} | {r['adaptive_tok_s']:.2f} |" in table
        assert f"| {r['depth_tok_s']:.2f} | {r['depth_speedup']:.2f}x |" in table
        for variant, t in r["latency"].items():
            assert 0 < t["ttft_p50"] <= t["ttft_p90"] and 0 < t["tpot_p50"] <= t["tpot_p90"]
            assert f"| {name} | {variant} | {t['ttft_p50']:.4f} |" in table
    assert "host_calls_per_token" not in report  # the cpu captures no graphs


def test_bench_adaptive_counts_host_calls_per_token_where_graphs_replay(tmp_path, monkeypatch):
    """On the emulated npu with step graphs: full compute and depth-wise batching replay
    (a few host calls a step), adaptive depth alone runs eagerly (an op launch each)."""
    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    report, table = _bench(
        tmp_path,
        "adaptive --preset tiny --device npu --step-graphs --input-len 8 --output-len 4 "
        "--runs 1 --concurrency 2 --block-size 16 --exit-threshold 0.5",
    )
    calls = report["host_calls_per_token"]
    assert report["depth_equals_adaptive"] is True
    assert calls["full"] < calls["adaptive"] and calls["depth"] < calls["adaptive"], calls
    assert "host calls per decode token" in table


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
        assert f"plan ({name}): {r['plan']}\n" in table
    for key in ("ttft_over_best", "tpot_over_best", "c2_best_over_this"):
        assert min(r[key] for r in plans.values()) == 1.0  # one plan is the best at each


def test_bench_structured_times_the_grammars_parts_against_unconstrained(tmp_path):
    report, table = _bench(
        tmp_path,
        "structured --preset tiny --input-len 8 --output-len 6 --runs 1 --concurrency 2 "
        "--block-size 16",
    )
    assert set(report["specs"]) == {"json", "regex"} and report["plan"] in table
    assert set(report["levels"]) == {"c1", "c2"}
    for level, rows in report["levels"].items():
        assert [r["kind"] for r in rows] == ["none", "json", "regex"]
        size = 1 if level == "c1" else 2
        for r in rows:
            assert r["tokens"] == 6 * size  # no grammar ends before --output-len
            assert _positive(r["tpot_s"]) and _positive(r["tok_s"])
            constrained = r["kind"] != "none"
            for part in ("mask", "apply", "accept"):
                assert (r[f"{part}_s_per_token"] > 0) == constrained, (level, r)
            assert f"| {r['kind']} | {r['tpot_s'] * 1e3:.2f} | {r['tpot_ratio']:.2f}x |" in table


def test_bench_detokenize_times_both_ways_at_each_length(tmp_path):
    report, table = _bench(tmp_path, "detokenize --preset tiny --lengths 50,200 --runs 2")
    assert [r["tokens"] for r in report["results"]] == [50, 200]
    for r in report["results"]:
        assert _positive(r["incremental_s_per_token"]) and _positive(r["full_decode_s_per_token"])
        assert f"| {r['tokens']} | {r['incremental_s_per_token'] * 1e6:.2f} |" in table


def test_the_floors_count_every_weight_a_step_reads_and_every_flop_of_a_prefill(tiny_ckpt):
    # Counted from the checkpoint's own safetensors headers, not from the formulas.
    from runtime_glue.bench import floors
    from runtime_glue.ouro.checkpoint import index_checkpoint
    from runtime_glue.ouro.config import OuroConfig

    cfg = OuroConfig.from_dir(tiny_ckpt)
    entries = index_checkpoint(tiny_ckpt)
    layers = [e for name, e in entries.items() if name.startswith("model.layers.")]
    layer_bytes = sum(e.nbytes for e in layers)
    lm_head = entries["lm_head.weight"].nbytes
    context = 37
    kv = 2 * cfg.num_planes * context * cfg.num_key_value_heads * cfg.head_dim * 2
    assert floors.decode_bytes(cfg, context) == cfg.total_ut_steps * layer_bytes + lm_head + kv
    per_token = 2 * cfg.total_ut_steps * layer_bytes // 2  # two FLOPs per bf16 weight
    assert floors.prefill_flops(cfg, 11) == 11 * per_token + 2 * lm_head // 2
