"""The cpu driver's own kernels, for CPUs without bf16 instructions (AVX2 + FMA).

- ``bf16_linear`` (``--linear avx2``, ``csrc/bf16_linear.c``). On such CPUs torch's bf16 GEMM
  runs at 12-18 GFLOP/s whatever the row count (measured on this project's 2-core EPYC; see
  docs/benchmarks.md), so one-row decode is compute-bound and prefill gets a fraction of the
  fp32 rate. The kernel reads the bf16 weights once, widens them in registers and sums in
  fp32: decode becomes bound by memory bandwidth, and batched rows share each weight read.
- ``paged_attention`` (``csrc/attention.c``): deterministic-mode attention read straight from
  the bf16 paged cache in fp32, one call per plane for every row of the step, instead of a
  gather, an fp32 copy of the whole context and two matmuls per request and row.
- ``rms_norm`` (``csrc/rms_norm.c``): deterministic-mode RMSNorm in one call instead of
  HF's ten torch operations (a decode step runs 4 per layer and loop).

None promises HF's bits (sums run in another order than torch's), but all are
row-invariant by construction, so deterministic mode can use them. The shared library is
built on first use with the system C compiler into ``$RLT_HAL_CACHE/kernels`` (default
~/.cache/rlt-hal), named by a hash of the sources and flags, and loaded with ctypes into a
process where torch has already loaded ``libgomp.so.1``, so both use one OpenMP thread pool.
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

import attrs
import torch

from hal.cache import cache_dir
from hal.interfaces import KERNEL_PREFIX
from hal.types import AttentionMetadata

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "bf16_linear.c", CSRC / "attention.c", CSRC / "rms_norm.c")
HEADERS = (CSRC / "bf16.h",)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


class KernelsUnavailable(RuntimeError):
    """The kernels cannot run here; the message says what to install or choose instead."""


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise KernelsUnavailable(
            f"the cpu driver's avx2 kernels are compiled on first use, and no C compiler {cc!r} was "
            "found: install one (apt install gcc) or set CC, or use --linear torch"
        )
    return cc


def _library_path(cc: str) -> Path:
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join((cc, *FLAGS)).encode()
    )
    return cache_dir() / "kernels" / f"rlt_cpu_kernels-{key.hexdigest()[:16]}.so"


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once per source version) and load the kernels; KernelsUnavailable if not here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelsUnavailable(
            f"the cpu driver's avx2 kernels need a CPU with AVX2 and FMA; torch reports "
            f"{capability!r}: use --linear torch"
        )
    cc = _compiler()
    path = _library_path(cc)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            proc = subprocess.run(
                [cc, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise KernelsUnavailable(
                    f"compiling {', '.join(map(str, SOURCES))} with {cc} failed:\n"
                    f"{proc.stderr.strip()}"
                )
            built.replace(path)  # atomic: concurrent builders never load a partial file
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"loading the cpu driver's kernels {path} failed: {exc}") from exc
    lib.rlt_bf16_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.rlt_bf16_linear.restype = ctypes.c_int
    lib.rlt_paged_attention.argtypes = (
        [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]  # q, its row and head strides
        + [ctypes.c_void_p] * 6  # k, v, slots, off, len, out
        + [ctypes.c_int] * 4  # rows, heads, kv_heads, d
        + [ctypes.c_float]  # scaling
    )
    lib.rlt_paged_attention.restype = ctypes.c_int
    lib.rlt_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.rlt_rms_norm.restype = None
    return lib


def _run(name: str, kernel, args) -> int:
    if torch._C._autograd._profiler_enabled():  # marking costs ~10 us a call: only when seen
        with torch.profiler.record_function(KERNEL_PREFIX + name):  # see KERNEL_PREFIX
            return kernel(*args)
    return kernel(*args)


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for bf16 CPU tensors, x ``[..., K]``, w ``[N, K]``, via the kernel."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise TypeError(f"avx2 linear takes bf16 CPU tensors, got {x.dtype} and {w.dtype}")
    n, k = w.shape
    rows = x.reshape(-1, k).contiguous()
    w = w.contiguous()  # a no-op for loaded weights
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    args = (rows.data_ptr(), w.data_ptr(), out.data_ptr(), rows.shape[0], n, k)
    if rows.shape[0] and _run("bf16_linear", load().rlt_bf16_linear, args):
        raise MemoryError(f"avx2 linear: no scratch memory for {rows.shape[0]} x {k} fp32")
    return out.view(*x.shape[:-1], n)


@attrs.frozen
class RowContexts:
    """Where each query row of a step reads its keys: ``slots[off[r] : off[r] + len[r]]``."""

    slots: torch.Tensor  # int64, every request's kv_slots back to back
    off: torch.Tensor  # int64 [rows]
    len: torch.Tensor  # int64 [rows]: context_len + i + 1 for the request's i-th row

    @classmethod
    def of(cls, meta: AttentionMetadata) -> RowContexts:
        off, lens = [0] * meta.num_tokens, [0] * meta.num_tokens
        base = 0
        for s in meta.seqs:
            for i in range(s.query_len):
                off[s.query_start + i], lens[s.query_start + i] = base, s.context_len + i + 1
            base += s.kv_len
        slots = torch.cat([s.kv_slots for s in meta.seqs]) if meta.seqs else torch.zeros(0)
        return cls(slots.long(), torch.tensor(off), torch.tensor(lens))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: RowContexts,
    scaling: float,
) -> torch.Tensor:
    """Deterministic-mode attention for every row of a step over one plane.

    ``query [1, heads, N, d]`` bf16 (any strides with d contiguous); ``key_cache`` and
    ``value_cache`` ``[slots, kv_heads, d]`` bf16 contiguous. Returns ``[N, heads * d]``.
    """
    _, heads, n, d = query.shape
    kv_heads = key_cache.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    for t in (query, key_cache, value_cache):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu":
            raise TypeError(f"paged_attention takes bf16 CPU tensors, got {t.dtype} on {t.device}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise TypeError("paged_attention takes contiguous K/V caches")
    out = query.new_empty(n, heads * d)
    args = (
        query.data_ptr(),
        query.stride(2),
        query.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        rows.slots.data_ptr(),
        rows.off.data_ptr(),
        rows.len.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        d,
        scaling,
    )
    if n and _run("paged_attention", load().rlt_paged_attention, args):
        raise MemoryError("cpu paged_attention: no scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (two bf16 roundings) over the last dim, its sum of squares in a fixed order."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise TypeError(f"rms_norm takes bf16 CPU tensors, got {x.dtype} and {weight.dtype}")
    n = weight.shape[0]
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    args = (rows.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), rows.shape[0], n, eps)
    _run("rms_norm", load().rlt_rms_norm, args)
    return out.view(x.shape)
