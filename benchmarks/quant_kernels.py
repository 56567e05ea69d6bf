"""Time the cpu driver's weight-only int8/int4 projections against its bf16 avx2 kernel.

Ouro-1.4B's four projection shapes at 1 and 8 rows, each kernel called on the same inputs;
the median of ``--calls`` calls after warm-up, in milliseconds, and the sum over the shapes
as a fraction of bf16 avx2's. Run from the repository root:

    python -m benchmarks.quant_kernels [--threads 2] [--calls 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from drivers.cpu import kernels, quant_kernels
from hal.quant import quantize

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
# (column, scheme, group size, kernel)
KERNELS = [
    ("bf16 avx2", "bf16", None, kernels.linear_avx2),
    ("int8-avx2", "int8", None, quant_kernels.int8_avx2),
    ("int8-torch", "int8", None, quant_kernels.int8_torch),
    ("int8-a8-avx2", "int8", None, quant_kernels.int8_a8_avx2),
    ("int4-avx2 g32", "int4", 32, quant_kernels.int4_avx2),
    ("int4-avx2 g128", "int4", 128, quant_kernels.int4_avx2),
    ("int4-a8-avx2 g32", "int4", 32, quant_kernels.int4_a8_avx2),
    ("int4-a8-avx2 g128", "int4", 128, quant_kernels.int4_a8_avx2),
    ("int4-torch g32", "int4", 32, quant_kernels.int4_torch),
    ("int4-torch g128", "int4", 128, quant_kernels.int4_torch),
]


def median_seconds(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split())
    isa = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    print(f"threads {args.threads}; CPU flags: {' '.join(isa)}")
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}")
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        weights[name] = {(s, g): w if s == "bf16" else quantize(w, s, g) for _, s, g, _ in KERNELS}
    for m in args.rows:
        print(f"\nM = {m} (ms, median of {args.calls})")
        print(f"{'kernel':16}" + "".join(f"{s:>10}" for s in SHAPES) + f"{'sum':>10}{'x bf16':>8}")
        base = None
        for label, scheme, group, fn in KERNELS:
            row = []
            for name, (_, k) in SHAPES.items():
                x = torch.randn(m, k, generator=gen).bfloat16()
                w = weights[name][(scheme, group)]
                row.append(median_seconds(lambda x=x, w=w, fn=fn: fn(x, w), args.calls) * 1e3)
            total = sum(row)
            base = base or total
            cells = "".join(f"{t:10.3f}" for t in row)
            print(f"{label:16}{cells}{total:10.3f}{total / base:8.2f}")
    print(f"\nload after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
