"""The cpu driver's own kernels, as torch custom ops (``torch.ops.rlt_cpu.*``).

- ``linear_avx2`` (``csrc/linear_avx2.c``): bf16 weights widened in registers, fp32 sums.
  On CPUs without bf16 instructions torch's bf16 GEMM runs at 12-18 GFLOP/s whatever the row
  count, and this kernel is several times faster at every row count.
- ``linear_avx512bf16`` (``csrc/linear_avx512bf16.c``): the same contract with AVX-512 BF16
  dot products, offered only where the CPU has them. There torch's GEMM is faster at large
  row counts and this kernel at small ones; the execution plan measures which to use where.
- the weight-only quantized projections: ``drivers.cpu.quant_kernels``.
- ``paged_attention`` (``csrc/attention.c``): deterministic-mode attention read straight from
  the bf16 paged cache, one call per plane for every row of a step; ``write_kv`` writes a
  step's K/V rows into a plane in one call (``driver.CpuKVStore``).
- ``rms_norm`` (``csrc/rms_norm.c``) and ``silu_mul`` (``csrc/silu_mul.c``): HF's roundings,
  with every row (every element) computed by the same code wherever it falls in a call.
- ``rotary`` (``csrc/rotary.c``): HF's rotary embedding with its bits (elementwise, three
  roundings), in one call instead of a dozen torch operations.

Only ``rotary`` is HF-exact; all the C kernels are row-invariant by construction. ``csrc/rlt_cpu.h``
declares their C interface once: the compiler checks the sources against it and cffi reads
it. The shared library is built on first use with the system C compiler into ``$RLT_HAL_CACHE/kernels``
(default ~/.cache/rlt-hal), named by a hash of the sources and flags, and loaded into a
process where torch has already loaded ``libgomp.so.1``, so both use one OpenMP thread pool.
As custom ops with fake implementations, the profiler records them by name and
``torch.compile`` can trace through them; called eagerly on plain tensors they run without
the op's dispatch (``custom_op``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from hal.cache import cache_dir
from hal.kernels import Kernel, KernelUnavailable

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "rlt_cpu.h"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


# Keys the execution plan's cached timings: any change to the C sources changes it.
VERSION = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))).hexdigest()[
    :16
]


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise KernelUnavailable(
            f"the cpu driver's kernels are compiled on first use, and no C compiler {cc!r} was "
            "found: install one (apt install gcc) or set CC, or use --linear torch"
        )
    return cc


def _library_path(cc: str) -> Path:
    key = hashlib.sha256(" ".join((VERSION, cc, *FLAGS)).encode())
    return cache_dir() / "kernels" / f"rlt_cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(cc: str, sources: list[Path], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        cmd = [cc, *FLAGS, "-I", str(CSRC), "-o", str(built), *map(str, sources), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(
                f"compiling {', '.join(map(str, sources))} with {cc} failed:\n{proc.stderr.strip()}"
            )
        built.replace(path)  # atomic: concurrent builders never load a partial file


@functools.cache
def library():
    """Build (once per source version) and load the kernels: ``(ffi, lib)``, or
    KernelUnavailable saying what is missing."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelUnavailable(
            f"the cpu driver's kernels need a CPU with AVX2 and FMA; torch reports "
            f"{capability!r}: use --linear torch"
        )
    import cffi

    cc = _compiler()
    sources = _sources()
    path = _library_path(cc)
    if not path.is_file():
        _build(cc, sources, path)
    ffi = cffi.FFI()
    ffi.cdef(_cdef(HEADER.read_text()))
    try:
        return ffi, ffi.dlopen(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"loading the cpu driver's kernels {path} failed: {exc}") from exc


def avx512bf16_available() -> None:
    """Raise KernelUnavailable unless this CPU, and torch's dispatch, have AVX-512 BF16."""
    _, lib = library()
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not lib.rlt_has_avx512bf16():
        raise KernelUnavailable(
            "the avx512bf16 kernel needs a CPU with avx512_bf16 (grep avx512_bf16 /proc/cpuinfo) "
            f"and torch's AVX512 dispatch (torch reports "
            f"{torch.backends.cpu.get_cpu_capability()!r})"
        )


_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_POINTER = re.compile(r"([(,]\s*)(?:const\s+)?\w+\s*\*\s*(\w+)")  # a pointer parameter


def _cdef(header: str) -> str:
    """The header as cffi reads it: without preprocessor lines, and with every pointer
    parameter an address (``uintptr_t``), so that a call passes ``Tensor.data_ptr()`` as it is.
    (cffi would otherwise need a pointer object per argument, made by ``ffi.cast`` at about
    3 us each, several times a C kernel's own time for a decode row. On the C side an address
    and a pointer are passed alike.)"""
    lines = [ln for ln in header.splitlines() if not ln.startswith("#")]
    return _POINTER.sub(r"\1uintptr_t \2", _COMMENT.sub("", "\n".join(lines)))


def _ptr(t: Tensor) -> int:
    """The address of ``t``'s first element, as the C kernels take it."""
    return t.data_ptr()


def _bf16_cpu(name: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype is not torch.bfloat16 or not t.is_cpu:
            raise TypeError(f"{name} takes bf16 CPU tensors, got {t.dtype} on {t.device}")


def _linear(name: str, x: Tensor, w: Tensor) -> Tensor:
    _bf16_cpu(name, x, w)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"{name}: x [..., {x.shape[-1]}] and w [{n}, {k}] do not match")
    flat = x.dim() == 2 and x.is_contiguous()  # the model's rows: used and returned as they are
    rows = x if flat else x.reshape(-1, k).contiguous()
    w = w.contiguous()  # a no-op for loaded weights
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    kernel = getattr(library()[1], f"rlt_{name}")
    if m and kernel(_ptr(rows), _ptr(w), _ptr(out), m, n, k):
        raise MemoryError(f"{name}: no scratch memory for {m} x {k}")
    return out if flat else out.view(*x.shape[:-1], n)


def bound_linear(name: str, operands: tuple[Tensor, ...], *ints: int):
    """``Kernel.into``'s call for the C linear ``rlt_NAME(x, *operands, out, M, *ints)``:
    the operands' addresses taken once, the call's own cost a few hundred nanoseconds (a
    wrapper's checks and its output's allocation cost several microseconds, a decode row's
    rms_norm about as much as the C kernel)."""
    kernel = getattr(library()[1], f"rlt_{name}")
    addresses = tuple(t.data_ptr() for t in operands)

    def call(out: Tensor, x: Tensor) -> None:
        if kernel(x.data_ptr(), *addresses, out.data_ptr(), x.shape[0], *ints):
            raise MemoryError(f"{name}: no scratch memory for {x.shape[0]} x {x.shape[1]}")

    call.operands = operands  # type: ignore[attr-defined]  # alive as long as the call
    return call


def _linear_into(name: str):
    def into(w: Tensor):
        _bf16_cpu(name, w)
        if w.dim() != 2 or not w.is_contiguous():
            raise TypeError(f"{name} binds a contiguous [N, K] weight")
        return bound_linear(name, (w,), *w.shape)

    return into


def _rms_norm_into(weight: Tensor, eps: float):
    _bf16_cpu("rms_norm", weight)
    weight, n, kernel = weight.contiguous(), weight.shape[0], library()[1].rlt_rms_norm
    w = weight.data_ptr()

    def call(out: Tensor, x: Tensor) -> None:
        kernel(x.data_ptr(), w, out.data_ptr(), x.shape[0], n, eps)

    call.operands = (weight,)  # type: ignore[attr-defined]
    return call


def _silu_mul_into():
    kernel = library()[1].rlt_silu_mul

    def call(out: Tensor, gate_up: Tensor) -> None:
        half = gate_up.shape[1] // 2
        gate = gate_up.data_ptr()
        kernel(gate, gate + 2 * half, gate_up.stride(0), out.data_ptr(), gate_up.shape[0], half)

    return call


def _rotary_into():
    kernel = library()[1].rlt_rotary

    def call(outs: tuple[Tensor, Tensor], q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
        n, hq, d = q.shape
        kernel(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
            cos.stride(0), outs[0].data_ptr(), outs[1].data_ptr(), n, hq, k.shape[1], d,
        )  # fmt: skip

    return call


def custom_op(qualname: str, fake):
    """``fn`` as the custom op ``qualname`` (``fake``: its fake implementation), called
    directly where nothing needs the op: torch's Python dispatch of a custom op costs 30-60
    us a call, several times a decode row's C kernel (one rms_norm row of 2048: about 70 us
    through the op, 6 us in C). A call goes through the op under ``torch.compile``, with the
    profiler on, or when its first argument is a tensor subclass (a fake tensor), so that
    traces, fake shapes and profiles see it by name."""

    def wrap(fn):
        op = torch.library.custom_op(qualname, fn, mutates_args=())
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args):
            if (
                type(args[0]) is not Tensor
                or torch.autograd.profiler._is_profiler_enabled
                or torch.compiler.is_compiling()
            ):
                return call.op(*args)  # type: ignore[attr-defined]
            return fn(*args)

        call.op = op  # type: ignore[attr-defined]
        return call

    return wrap


def _linear_fake(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


@custom_op("rlt_cpu::linear_avx2", _linear_fake)
def linear_avx2(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear(x, w)`` for bf16 CPU tensors, x ``[..., K]``, w ``[N, K]``: AVX2 + FMA."""
    return _linear("linear_avx2", x, w)


@custom_op("rlt_cpu::linear_avx512bf16", _linear_fake)
def linear_avx512bf16(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear(x, w)`` with AVX-512 BF16 dot products (see ``avx512bf16_available``)."""
    return _linear("linear_avx512bf16", x, w)


def _attention_fake(query, key_cache, value_cache, slots, off, lens, scaling):
    return query.new_empty(query.shape[2], query.shape[1] * query.shape[3])


@custom_op("rlt_cpu::paged_attention", _attention_fake)
def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slots: Tensor,
    off: Tensor,
    lens: Tensor,
    scaling: float,
) -> Tensor:
    """Deterministic-mode attention for every row of a step over one plane.

    ``query [1, heads, N, d]`` bf16 (any strides with d contiguous); ``key_cache`` and
    ``value_cache`` ``[slots, kv_heads, d]`` bf16 contiguous. Row r reads its keys at
    ``slots[off[r] : off[r] + lens[r]]`` (int64). Returns ``[N, heads * d]``.
    """
    _bf16_cpu("paged_attention", query, key_cache, value_cache)
    _, heads, n, d = query.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise TypeError("paged_attention takes contiguous K/V caches")
    for t in (slots, off, lens):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise TypeError("paged_attention's slots, off and lens are contiguous int64")
    out = query.new_empty(n, heads * d)
    args = [query.stride(2), query.stride(1), _ptr(key_cache), _ptr(value_cache)]
    args += [_ptr(slots), _ptr(off), _ptr(lens), _ptr(out), n, heads, key_cache.shape[1], d]
    if n and library()[1].rlt_paged_attention(_ptr(query), *args, scaling):
        raise MemoryError("cpu paged_attention: no scratch memory")
    return out


def write_kv(key: Tensor, value: Tensor, slots: Tensor, k_rows: Tensor, v_rows: Tensor) -> bool:
    """Rows ``key``, ``value`` ``[N, kv_heads, d]`` into ``k_rows``/``v_rows`` ``[S, kv_heads, d]``
    (a plane of the paged cache onwards, ``TensorKVStore.rows``) at ``slots`` (int64), in one
    call: what ``index_put_`` does there, with each row's heads contiguous. False (nothing
    written) where the call does not fit the C form (another dtype, layout or device)."""
    n, heads, d = key.shape
    if not (
        key.dtype is value.dtype is k_rows.dtype is v_rows.dtype is torch.bfloat16
        and key.is_cpu and value.is_cpu and slots.is_cpu and k_rows.is_cpu and v_rows.is_cpu
        and value.shape == key.shape and slots.shape == (n,)
        and key.stride()[1:] == value.stride()[1:] == (d, 1)
        and k_rows.shape == v_rows.shape and k_rows.shape[1:] == (heads, d)
        and k_rows.is_contiguous() and v_rows.is_contiguous()
        and slots.dtype == torch.int64 and slots.is_contiguous()
    ):  # fmt: skip
        return False
    if n and library()[1].rlt_write_kv(
        _ptr(key), key.stride(0), _ptr(value), value.stride(0), _ptr(slots), n,
        _ptr(k_rows), _ptr(v_rows), k_rows.shape[0], heads * d,
    ):  # fmt: skip
        raise IndexError(
            f"write_kv: a slot of {slots.tolist()} lies outside [0, {k_rows.shape[0]})"
        )
    return True


def bound_attention(key_cache: Tensor, value_cache: Tensor, slots: Tensor, rows, scaling: float):
    """``AttentionBackend.bind`` on the cpu: ``write_kv`` and ``paged_attention`` called on a
    plane's address (``TensorKVStore.rows``' first row) with the checks they make done once:
    caches ``[planes, slots, kv_heads, d]`` bf16 contiguous, ``slots`` int64 (the step's
    ``slot_mapping``), ``rows`` its ``RowContexts``. Keys and values come as the model's
    loop makes them: bf16 ``[N, kv_heads, d]`` with each row's heads contiguous; queries
    ``[1, heads, N, d]`` with d contiguous."""
    from hal.interfaces import BoundAttention

    planes, num_slots, kv_heads, d = key_cache.shape
    plane_bytes, lib = num_slots * kv_heads * d * key_cache.itemsize, library()[1]
    keys, values, n = key_cache.data_ptr(), value_cache.data_ptr(), slots.shape[0]
    at, off, lens = slots.data_ptr(), rows.off.data_ptr(), rows.len.data_ptr()
    context = rows.slots.data_ptr()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise TypeError("bound_attention takes contiguous K/V caches")

    def write(plane: int, key: Tensor, value: Tensor) -> None:
        if n and lib.rlt_write_kv(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), at, n,
            keys + plane * plane_bytes, values + plane * plane_bytes,
            (planes - plane) * num_slots, kv_heads * d,
        ):  # fmt: skip
            raise IndexError(
                f"write_kv: a slot of {slots.tolist()} lies outside "
                f"[0, {(planes - plane) * num_slots})"
            )

    def attend(query: Tensor, plane: int, out: Tensor) -> None:
        _, heads, rows_n, _ = query.shape
        if rows_n and lib.rlt_paged_attention(
            query.data_ptr(), query.stride(2), query.stride(1), keys + plane * plane_bytes,
            values + plane * plane_bytes, context, off, lens, out.data_ptr(), rows_n, heads,
            kv_heads, d, scaling,
        ):  # fmt: skip
            raise MemoryError("cpu paged_attention: no scratch memory")

    return BoundAttention(write, attend, (key_cache, value_cache, slots, rows))


@custom_op("rlt_cpu::rms_norm", lambda x, weight, eps: torch.empty_like(x))
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm (two bf16 roundings) over the last dim, its sum of squares in a fixed order."""
    _bf16_cpu("rms_norm", x, weight)
    n = weight.shape[0]
    if x.shape[-1] != n:
        raise ValueError(f"rms_norm: x [..., {x.shape[-1]}] and weight [{n}] do not match")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    library()[1].rlt_rms_norm(
        _ptr(rows), _ptr(weight.contiguous()), _ptr(out), rows.shape[0], n, eps
    )
    return out if rows is x else out.view(x.shape)


@custom_op("rlt_cpu::silu_mul", lambda gate, up: gate.new_empty(gate.shape))
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``bf16(bf16(silu(gate)) * up)`` for ``[M, I]`` views sharing one row stride."""
    _bf16_cpu("silu_mul", gate, up)
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride() != up.stride():
        raise TypeError("silu_mul takes two [M, I] tensors with the same strides")
    if gate.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype)
    library()[1].rlt_silu_mul(_ptr(gate), _ptr(up), gate.stride(0), _ptr(out), rows, cols)
    return out


@custom_op(
    "rlt_cpu::rotary",
    lambda q, k, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)),
)
def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """HF's ``apply_rotary_pos_emb`` (its bits): ``q [N, Hq, d]``, ``k [N, Hk, d]`` with heads
    contiguous (views of a q|k|v projection), ``cos``, ``sin`` ``[N, d]``."""
    _bf16_cpu("rotary", q, k, cos, sin)
    n, hq, d = q.shape
    hk = k.shape[1]
    if k.shape != (n, hk, d) or cos.shape != (n, d) or sin.shape != cos.shape or d % 2:
        raise ValueError(f"rotary: q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)}")
    if q.stride()[1:] != (d, 1):
        q = q.contiguous()
    if k.stride()[1:] != (d, 1):
        k = k.contiguous()
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo, ko = torch.empty(n, hq, d, dtype=q.dtype), torch.empty(n, hk, d, dtype=k.dtype)
    library()[1].rlt_rotary(
        _ptr(q), q.stride(0), _ptr(k), k.stride(0), _ptr(cos), _ptr(sin), cos.stride(0),
        _ptr(qo), _ptr(ko), n, hq, hk, d,
    )  # fmt: skip
    return qo, ko


def _loaded() -> None:
    library()


KERNELS = (
    Kernel(
        "linear",
        "avx2",
        linear_avx2,
        row_invariant=True,
        column_invariant=True,
        check=_loaded,
        version=VERSION,
        description="csrc/linear_avx2.c: fp32 FMA sums over bf16 widened in registers",
        into=_linear_into("linear_avx2"),
    ),
    Kernel(
        "linear",
        "avx512bf16",
        linear_avx512bf16,
        row_invariant=True,
        column_invariant=True,
        check=avx512bf16_available,
        version=VERSION,
        description="csrc/linear_avx512bf16.c: vdpbf16ps dot products",
        into=_linear_into("linear_avx512bf16"),
    ),
    Kernel(
        "rms_norm",
        "avx2",
        rms_norm,
        row_invariant=True,
        check=_loaded,
        version=VERSION,
        description="csrc/rms_norm.c: HF's roundings, fixed-order sum of squares",
        into=_rms_norm_into,
    ),
    Kernel(
        "silu_mul",
        "avx2",
        silu_mul,
        row_invariant=True,
        check=_loaded,
        version=VERSION,
        description="csrc/silu_mul.c: HF's roundings, one exp code path for every element",
        into=_silu_mul_into,
    ),
    Kernel(
        "rotary",
        "avx2",
        rotary,
        hf_exact=True,
        row_invariant=True,
        check=_loaded,
        version=VERSION,
        description="csrc/rotary.c: HF's three roundings, elementwise",
        into=_rotary_into,
    ),
)
