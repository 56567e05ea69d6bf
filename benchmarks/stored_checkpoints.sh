#!/usr/bin/env bash
# bench latency on a bf16 checkpoint and on what `rlt-hal quantize` makes of it in the formats
# users bring (compressed-tensors W4A16, msModelSlim W8A8_DYNAMIC), ROUNDS interleaved rounds,
# each row its own process; then the median TPOT of each and its ratio to bf16's.
#   benchmarks/stored_checkpoints.sh BF16_DIR OUT_DIR [ROUNDS]
set -euo pipefail
src=$1 out=$2 rounds=${3:-2}
mkdir -p "$out"
[ -d "$out/ct-w4a16" ] || rlt-hal quantize "$src" "$out/ct-w4a16" --scheme w4a16 --group-size 128
[ -d "$out/ms-w8a8" ] || rlt-hal quantize "$src" "$out/ms-w8a8" --scheme w8a8-dynamic \
    --format msmodelslim
for r in $(seq "$rounds"); do
    for name in bf16 ct-w4a16 ms-w8a8; do
        dir=$src
        [ "$name" = bf16 ] || dir=$out/$name
        rlt-hal bench latency --model "$dir" --input-lens 64 --output-len 16 --runs 1 \
            --json "$out/$name-$r.json" >"$out/$name-$r.log" 2>&1
        echo "round $r $name: $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def tpot(name):
    vals = []
    for r in range(1, rounds + 1):
        rep = json.load(open(f"{out}/{name}-{r}.json"))
        vals.append(round(rep["results"][0]["tpot_s"]["p50"], 3))
    return statistics.median(vals), vals
base = tpot("bf16")[0]
for name in ("bf16", "ct-w4a16", "ms-w8a8"):
    med, vals = tpot(name)
    rep = json.load(open(f"{out}/{name}-1.json"))
    print(f"{name}: {rep['weights']['scheme']}, {rep['weights']['bytes_per_token'] / 2**30:.2f} "
          f"GiB/token, TPOT median {med:.3f} s {vals}, {med / base:.2f}x bf16")
PY
