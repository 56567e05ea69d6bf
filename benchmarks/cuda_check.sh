#!/usr/bin/env bash
# docs/cuda.md's checks on a CUDA GPU in one run: the hardware tests, the conformance kit, the
# latency of eager decoding vs step graphs (ouro-1.4b-shape), int8 and int4 weights, bench graphs, self-speculation
# with and without graphs, and last the whole suite with cuda joining every cross-driver case
# (given whatever time is left before the deadline). Every step runs, whatever an earlier one
# returned; the log says each step's exit status and seconds.
# Usage: benchmarks/cuda_check.sh OUT_DIR [SECONDS]   (SECONDS: the whole run's budget, 480;
# SPEC_PRESET=trained runs the speculation steps on the trained preset, trained on first use)
# Needs a CUDA build of torch and rlt-hal installed (pip install -e ".[test]").
set -u
out=${1:?usage: $0 OUT_DIR [SECONDS]}
budget=${2:-480}
mkdir -p "$out"
log="$out/cuda-check.log"
deadline=$(($(date +%s) + budget))
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
B="$PY -m runtime_glue.cli.main bench"
T="$PY -m pytest -q -p no:cacheprovider"

step() { # step NAME SECONDS COMMAND...: the command under a timeout, its output in the log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$log"
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"device", torch.cuda.get_device_name(0))'
    grep -o -E 'avx512_bf16|amx_bf16|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '
    echo "cores $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$log" 2>&1

step checkpoints 150 "$PY" -c 'from runtime_glue.ouro.toy import cached_checkpoint as c
print(c("ouro-1.4b-shape"), c("small"))'
step hardware 150 $T --run-cuda tests/test_cuda_hardware.py -rA
step kit 90 $T --pyargs hal.testing --rlt-driver cuda
L="--preset ouro-1.4b-shape --device cuda --input-lens 64 --output-len 64 --runs 3"
step latency-eager 120 $B latency $L --no-step-graphs --json "$out/cuda-latency.json"
step latency-graphs 120 $B latency $L --step-graphs --json "$out/cuda-latency-graphs.json"
step latency-int8 120 $B latency $L --step-graphs --quantization int8 --json "$out/cuda-latency-int8.json"
step latency-int4 120 $B latency $L --step-graphs --quantization int4 --quantization-group-size 128 \
    --json "$out/cuda-latency-int4.json"
step graphs 90 $B graphs --preset ouro-1.4b-shape --device cuda --batches 1,4 \
    --json "$out/cuda-graphs.json"
S="--preset ${SPEC_PRESET:-small} --device cuda --speculative-loops 1 --num-speculative-tokens 3"
step speculative 90 $B speculative $S --no-step-graphs --concurrency 1 \
    --json "$out/cuda-speculative.json"
step speculative-graphs 90 $B speculative $S --step-graphs --concurrency 1 \
    --json "$out/cuda-speculative-graphs.json"
left=$((deadline - $(date +%s)))
if [ "$left" -gt 60 ]; then
    step suite "$left" $T --run-cuda -n "${WORKERS:-8}" -rfE --junitxml="$out/cuda-suite.xml"
else
    echo "== suite: skipped, $left s left" | tee -a "$log"
fi
grep -E '^== .*exit' "$log"
