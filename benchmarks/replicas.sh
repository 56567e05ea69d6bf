#!/usr/bin/env bash
# Data-parallel replicas on Ray Serve against one engine, on the same cores (about 10 minutes on
# 2 cores): `rlt-hal serve` (no Ray: the baseline), then --replicas 1 with every core, then
# --replicas N with cores/N each, each under the same `rlt-hal bench serve` load (a warm-up
# pass, then ROUNDS measured ones). Medians and ratios land in OUT_DIR/replicas.json.
# Usage: benchmarks/replicas.sh OUT_DIR   (needs the ray extra: make test-ray builds .venv-ray)
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
RLT=${RLT_HAL:-.venv-ray/bin/rlt-hal}
PY=$(dirname "$RLT")/python
MODEL=${MODEL:-${RLT_HAL_CACHE:-$HOME/.cache/rlt-hal}/toy-small-seed0}
CORES=${CORES:-$(nproc)}
N=${N:-2}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-8124}
LOAD="--concurrency 8 --num-requests 32 --input-len 64 --output-len 32"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
test -f "$MODEL/config.json" || $RLT toy-checkpoint "$MODEL" --preset small

measure() {  # NAME, then the serve options
    local name=$1; shift
    setsid $RLT serve --model "$MODEL" --port "$PORT" "$@" >"$out/$name.log" 2>&1 &
    local server=$!
    trap "kill -INT -$server 2>/dev/null || true" EXIT
    for _ in $(seq 180); do
        grep -q "^serving" "$out/$name.log" && break
        kill -0 $server 2>/dev/null || { cat "$out/$name.log"; exit 1; }
        sleep 1
    done
    $RLT bench serve --url "http://127.0.0.1:$PORT/v1" $LOAD --json "$out/$name-warmup.json" >/dev/null
    for r in $(seq "$ROUNDS"); do
        $RLT bench serve --url "http://127.0.0.1:$PORT/v1" $LOAD --json "$out/$name-$r.json"
    done
    kill -INT -$server
    wait $server || true
    trap - EXIT
}

measure engine
measure replicas-1 --replicas 1 --cpus-per-replica "$CORES" --device cpu
measure "replicas-$N" --replicas "$N" --cpus-per-replica "$((CORES / N))" --device cpu

$PY - "$out" "$N" "$ROUNDS" "$CORES" <<'EOF'
import json, statistics, sys
from pathlib import Path

from runtime_glue.bench.engine_bench import machine

out, n, rounds, cores = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
configs = {"engine": "rlt-hal serve (no Ray)", "replicas-1": "Ray Serve, 1 replica",
           f"replicas-{n}": f"Ray Serve, {n} replicas"}
report = {"machine": machine(), "cores": cores, "rounds": rounds, "configs": {}}
for name, label in configs.items():
    levels = [json.loads((out / f"{name}-{r}.json").read_text())["levels"][0]
              for r in range(1, rounds + 1)]
    report["configs"][name] = {
        "label": label,
        "errors": sum(level["errors"] for level in levels),
        "output_tok_s": [level["output_tok_s"] for level in levels],
        "median_output_tok_s": statistics.median(level["output_tok_s"] for level in levels),
        "median_ttft_p50_s": statistics.median(level["ttft_s"]["p50"] for level in levels),
    }
c = report["configs"]
report[f"ratio_{n}_replicas_vs_1"] = (c[f"replicas-{n}"]["median_output_tok_s"]
                                      / c["replicas-1"]["median_output_tok_s"])
report[f"ratio_{n}_replicas_vs_engine"] = (c[f"replicas-{n}"]["median_output_tok_s"]
                                           / c["engine"]["median_output_tok_s"])
(out / "replicas.json").write_text(json.dumps(report, indent=2))
print(f"| server | median output tok/s (c=8, {rounds} rounds) | TTFT p50 (s) | errors |")
print("|---|---|---|---|")
for v in c.values():
    print(f"| {v['label']} | {v['median_output_tok_s']:.1f} | {v['median_ttft_p50_s']:.3f} "
          f"| {v['errors']} |")
print(f"{n} replicas / 1 replica: {report[f'ratio_{n}_replicas_vs_1']:.2f}x; "
      f"/ no Ray: {report[f'ratio_{n}_replicas_vs_engine']:.2f}x "
      f"({cores} cores, {' '.join(report['machine']['cpu_flags'])})")
EOF
