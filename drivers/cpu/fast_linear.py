"""``avx2``: a bf16 linear layer for CPUs without bf16 instructions (AVX2 + FMA).

On such CPUs torch's bf16 GEMM runs at 12-18 GFLOP/s whatever the row count (measured on
this project's 2-core EPYC; see docs/benchmarks.md), so one-row decode is compute-bound
and prefill gets a fraction of the fp32 rate. ``csrc/bf16_linear.c`` reads the bf16 weights
once, widens them in registers and accumulates in fp32: decode becomes bound by memory
bandwidth, and batched rows share each weight read.

It is not HF-exact (the sums run in another order than torch's), but it is row-invariant by
construction, so deterministic mode can use it. The shared library is built on first use
with the system C compiler into ``$RLT_HAL_CACHE/kernels`` (default ~/.cache/rlt-hal), named
by a hash of the source and flags, and loaded with ctypes into a process where torch has
already loaded ``libgomp.so.1``, so both use one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hal.cache import cache_dir
from hal.interfaces import KERNEL_PREFIX

SOURCE = Path(__file__).with_name("csrc") / "bf16_linear.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


class FastLinearUnavailable(RuntimeError):
    """The kernel cannot run here; the message says what to install or choose instead."""


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise FastLinearUnavailable(
            f"the avx2 linear kernel is compiled on first use, and no C compiler {cc!r} was "
            "found: install one (apt install gcc) or set CC, or use --linear torch"
        )
    return cc


def _library_path(cc: str) -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS)).encode()).hexdigest()
    return cache_dir() / "kernels" / f"bf16_linear-{key[:16]}.so"


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once per source version) and load the kernel; FastLinearUnavailable if not here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise FastLinearUnavailable(
            f"the avx2 linear kernel needs a CPU with AVX2 and FMA; torch reports "
            f"{capability!r}: use --linear torch"
        )
    cc = _compiler()
    path = _library_path(cc)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            proc = subprocess.run(
                [cc, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise FastLinearUnavailable(
                    f"compiling {SOURCE} with {cc} failed:\n{proc.stderr.strip()}"
                )
            built.replace(path)  # atomic: concurrent builders never load a partial file
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise FastLinearUnavailable(f"loading the avx2 linear kernel {path} failed: {exc}") from exc
    lib.rlt_bf16_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.rlt_bf16_linear.restype = ctypes.c_int
    return lib


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for bf16 CPU tensors, x ``[..., K]``, w ``[N, K]``, via the kernel."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise TypeError(f"avx2 linear takes bf16 CPU tensors, got {x.dtype} and {w.dtype}")
    n, k = w.shape
    rows = x.reshape(-1, k).contiguous()
    w = w.contiguous()  # a no-op for loaded weights
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    args = (rows.data_ptr(), w.data_ptr(), out.data_ptr(), rows.shape[0], n, k)
    kernel = load().rlt_bf16_linear
    if torch._C._autograd._profiler_enabled():  # marking costs ~10 us a call: only when seen
        with torch.profiler.record_function(KERNEL_PREFIX + "bf16_linear"):  # see KERNEL_PREFIX
            failed = rows.shape[0] and kernel(*args)
    else:
        failed = rows.shape[0] and kernel(*args)
    if failed:
        raise MemoryError(f"avx2 linear: no scratch memory for {rows.shape[0]} x {k} fp32")
    return out.view(*x.shape[:-1], n)
