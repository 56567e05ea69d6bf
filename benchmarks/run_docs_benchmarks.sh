#!/usr/bin/env bash
# Reproduce the CPU figures in docs/benchmarks.md (about 60 minutes on 2 cores). Which plan the
# defaults resolve to depends on the CPU (rlt-hal plan shows it); every report names it.
# Usage: benchmarks/run_docs_benchmarks.sh OUT_DIR   (JSON reports land in OUT_DIR)
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
B="${RLT_HAL:-.venv/bin/rlt-hal} bench"
# The execution plan's section (2026-12-03, a CPU with avx512_bf16).
$B plans --preset ouro-1.4b-shape --input-len 64 --output-len 16 --runs 3 --concurrency 8 \
    --json "$out/ouro-plans.json"
$B latency --preset ouro-1.4b-shape --input-lens 64 --output-len 16 --runs 2 --warmup 0 \
    --json "$out/ouro-latency-plan.json"
$B baseline --preset ouro-1.4b-shape --input-len 64 --output-len 16 --runs 1 --concurrency 8 \
    --json "$out/ouro-baseline-plan.json"
$B detokenize --preset small --json "$out/detokenize.json"
# The HF-exact tables: HF-exact mode with torch's kernels, the defaults when they were taken.
X="--no-deterministic --linear torch"
$B latency $X --preset small --input-lens 64,512,2048 --output-len 64 --runs 3 --warmup 1 \
    --json "$out/small-latency.json"
$B baseline $X --preset small --input-len 64 --output-len 32 --runs 3 \
    --json "$out/small-baseline.json"
$B determinism --preset small --input-len 64 --output-len 32 --runs 3 \
    --json "$out/small-determinism.json"
$B latency $X --preset ouro-1.4b-shape --input-lens 64,512 --output-len 16 --runs 1 --warmup 0 \
    --json "$out/ouro-latency.json"
$B baseline $X --preset ouro-1.4b-shape --input-len 16 --output-len 8 --runs 1 \
    --json "$out/ouro-baseline.json"
$B determinism --preset ouro-1.4b-shape --input-len 16 --output-len 8 --runs 1 \
    --json "$out/ouro-determinism.json"
# The cpu defaults of 2026-12-02 (deterministic mode, avx2): runs A, B and C of the docs.
A="--linear avx2"
$B latency $A --preset ouro-1.4b-shape --input-lens 64,512 --output-len 16 --runs 1 --warmup 0 \
    --json "$out/ouro-latency-defaults-a.json"
$B latency $A --preset ouro-1.4b-shape --input-lens 64 --output-len 32 --runs 3 --warmup 0 \
    --json "$out/ouro-latency-defaults-b.json"
$B latency $A --preset ouro-1.4b-shape --input-lens 64,512 --output-len 32 --runs 2 --warmup 0 \
    --json "$out/ouro-latency-defaults-c.json"
$B baseline $A --preset ouro-1.4b-shape --input-len 16 --output-len 8 --runs 1 \
    --json "$out/ouro-baseline-defaults.json"
$B baseline $A --preset small --input-len 64 --output-len 32 --runs 3 \
    --json "$out/small-baseline-defaults.json"
# Over HTTP (small): a real server, then the openai client against it.
${RLT_HAL:-.venv/bin/rlt-hal} serve --model "${RLT_HAL_CACHE:-$HOME/.cache/rlt-hal}/toy-small-seed0" \
    --port 8123 & server=$!
trap 'kill $server' EXIT
for _ in $(seq 60); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
$B serve --url http://127.0.0.1:8123/v1 --concurrency 1,8 --num-requests 16 --input-len 64 \
    --output-len 32 --json "$out/small-serve.json"
