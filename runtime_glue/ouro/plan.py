"""The execution plan: every decision about how a model runs, made once (``runtime_glue.ouro.resolve``).

An :class:`ExecutionPlan` names the mode, the attention backend, whether q|k|v and gate|up
run as one stacked projection, and for every op the driver's kernel and the row tiles it is
called with. ``runtime_glue.ouro.resolve.resolve`` builds it from the driver's offered kernels (``hal.kernels``),
the checkpoint's shapes, the user's flags and measurements taken on the machine at hand.
The model is built from the plan and never changes; nothing else decides.

Modes:

- ``hf-exact``: torch's forms everywhere, HF's call shapes: a lone request equals the
  HF-module reference bit for bit.
- ``deterministic``: a request's bits do not depend on chunking or on the other requests of
  a step. Two rules make that true by construction:

  1. *Row kinds.* A row is a prompt position or a generated position; which one is a fact
     about its request, not about the step. Each op has one kernel for prompt rows and one
     for generated rows (torch's GEMM may be fastest at prefill, a driver's kernel at
     decode), and the engine puts prompt rows first in every step.
  2. *Tiles.* Every call has a row count from a finite set (``OpChoice.tiles``, powers of
     two): larger calls are cut into tiles, a remainder is padded with zero rows, and every
     tile starts 64-byte aligned. At start-up ``hal.kernels.check_rows`` runs exactly those call shapes,
     every row position of each, on inputs built so that any two summation orders give
     different bits; a kernel that fails is never used for that op.

  If no offered kernel passes for some op, an explicitly requested mode refuses to start
  (naming the op and its shape); the default mode falls back to hf-exact and logs why.
- ``fast``: a kernel the user named, outside deterministic mode: neither guarantee. With
  ``--mode fast`` the driver's fused kernels and fused attention backend, each admitted only
  after a comparison on this device at this model's shapes (``runtime_glue.ouro.admission``);
  the plan records every verdict (``ExecutionPlan.admissions``) and ``fused`` names the
  kernels of the fused-only ops (``add_rms_norm``, ``rotary``), torch's where refused (for
  ``add_rms_norm``: HF's add, then the plan's own ``rms_norm``).

A deterministic or fast plan also runs the rotary embedding as one kernel where the driver
offers one with HF's bits for every call (``exact_rotary``): the same bits as the composition
it replaces, so choosing it changes nothing but time.

How the plan is resolved, by checks and measurements: ``runtime_glue.ouro.resolve``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from hal.kernels import Kernel
from runtime_glue.ouro.exits import ExitMode

KINDS = ("prompt", "generated")
LINEAR_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "exit_gate")
SAMPLED_OPS = ("lm_head", "exit_gate")  # run on a step's sampled rows only
OPS = (*LINEAR_OPS, "rms_norm", "silu_mul")
# The largest deterministic call, fixed so that the plan never depends on engine settings (a
# chunk size that changed a kernel or tile would change bits): prompt rows reach the GEMM
# rates of prefill at 256; a step rarely samples more than 64 rows.
PROMPT_TILE = 256
GENERATED_TILE = 64
ALIGN = 64  # bytes: every deterministic call's input starts at such an address


def hal_op(op: str) -> str:
    """The ``hal.kernels`` op implementing a plan op (``qkv_proj`` -> ``linear``)."""
    return "linear" if op in LINEAR_OPS else op


@attrs.frozen
class OpChoice:
    kernel: str
    tiles: tuple[int, ...] = ()  # row counts of every call, ascending; () = any


@attrs.frozen
class Measurement:
    op: str
    kind: str
    kernel: str
    rows: int
    seconds: float


@attrs.frozen
class Admission:
    """One fused kernel's check on the device: its worst error against float64, the bound."""

    op: str
    kernel: str
    admitted: bool
    why: str
    error: float | None = None  # max over elements of |out - f64| / bound scale
    bound: float | None = None


@attrs.frozen
class ExecutionPlan:
    mode: str  # "deterministic", "hf-exact" or "fast"
    attention: str
    stacked: bool  # one projection on q|k|v and on gate|up
    prompt: tuple[tuple[str, OpChoice], ...]
    generated: tuple[tuple[str, OpChoice], ...]
    measurements: tuple[Measurement, ...] = ()
    notes: tuple[str, ...] = ()  # why: fallbacks, refused kernels, where timings came from
    exit_defaults: ExitMode = ExitMode()  # for requests that choose no exit mode
    adaptive_depth: bool = False  # exiting decode rows skip their remaining loops
    # The kernels of add_rms_norm and rotary where they run as one (--mode fast; rotary also
    # in deterministic mode, exact_rotary); an op not named composes the plan's own kernels.
    fused: tuple[tuple[str, str], ...] = ()
    admissions: tuple[Admission, ...] = ()  # --mode fast: each fused kernel's verdict
    quantization: str = "bf16"  # the projections' weights (hal.quant): "int4 (group 32)"

    @property
    def deterministic(self) -> bool:
        return self.mode == "deterministic"

    @property
    def split(self) -> bool:
        """Whether prompt and generated rows run different kernels."""
        return self.prompt != self.generated

    def choice(self, kind: str, op: str) -> OpChoice:
        return dict(self.prompt if kind == "prompt" else self.generated)[op]

    def describe(self) -> str:
        """The plan in one line (logged at start by generate and serve)."""

        def kinds(op: str) -> str:
            a, b = (_label(self.choice(k, op)) for k in KINDS)
            return a if a == b else f"{a} (prompt) / {b} (generated)"

        fused = "; q|k|v and gate|up stacked" if self.stacked else ""
        ops = ", ".join(f"{op} {kinds(op)}" for op in OPS)
        exits = f"; {self.exit_defaults.describe()} by default"
        adaptive = ", adaptive depth" if self.adaptive_depth else ""
        if self.fused:
            ops += ", " + ", ".join(f"{op} {k}" for op, k in self.fused)
        weights = f"{self.quantization} weights, " if self.quantization != "bf16" else ""
        return (
            f"{self.mode} mode, {weights}{self.attention} attention; {ops}{fused}{exits}{adaptive}"
        )

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "attention": self.attention,
            "stacked": self.stacked,
            **{kind: {op: attrs.asdict(c) for op, c in getattr(self, kind)} for kind in KINDS},
            "measurements": [attrs.asdict(m) for m in self.measurements],
            "notes": list(self.notes),
            "exit_defaults": attrs.asdict(self.exit_defaults),
            "adaptive_depth": self.adaptive_depth,
            "fused": dict(self.fused),
            "admissions": [attrs.asdict(a) for a in self.admissions],
            "quantization": self.quantization,
        }


def _label(c: OpChoice) -> str:
    if not c.tiles:
        return c.kernel
    return f"{c.kernel}[{c.tiles[0]}..{c.tiles[-1]}]"


def exact_rotary(driver) -> str | None:
    """The driver's own rotary kernel with HF's bits and row invariance (each claim checked by
    the conformance kit), where one can run here: a plan may take it in place of the
    composition at no cost in bits."""
    for k in driver.kernels_for("rotary"):
        exact = k.name != "torch" and k.hf_exact and k.row_invariant and not k.fast_only
        if exact and k.available() is None:
            return k.name
    return None


# -- executing a choice: row tiles ----------------------------------------------------------


def row_tiled(fn: Callable[..., torch.Tensor], tiles: tuple[int, ...]) -> Callable:
    """``fn(x, *consts)`` issued only with row counts in ``tiles``, on 64-byte-aligned rows.

    Rows of ``x`` are cut into tiles of ``tiles[-1]``, and a remainder is padded with zero
    rows to the smallest tile that holds it. Without tiles, ``fn`` itself.
    """
    if not tiles:
        return fn
    largest, allowed = tiles[-1], frozenset(tiles)

    def call(x: torch.Tensor, *consts):
        m = x.shape[0]
        if m == 0:  # no row, no bits to keep
            return fn(x, *consts)
        if m in allowed:
            return fn(_aligned(x), *consts)
        parts = [
            fn(_aligned(x[start : start + largest]), *consts)
            for start in range(0, m - m % largest, largest)
        ]
        r = m % largest
        if r:
            pad = x.new_zeros(next(t for t in tiles if t >= r), *x.shape[1:])
            pad[:r] = x[m - r :]
            parts.append(fn(pad, *consts)[:r])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    return call


def _aligned(x: torch.Tensor) -> torch.Tensor:
    if x.is_contiguous() and x.data_ptr() % ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)  # one copy, freshly allocated


def on_halves(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """``silu_mul`` as a one-row-tensor op: ``fn(gate, up)`` on the halves of gate|up rows."""

    def call(gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return fn(gate_up[:, :half], gate_up[:, half:])

    return call


def row_function(op: str, kernel: Kernel, tiles: tuple[int, ...]) -> Callable:
    """The callable a model runs for ``op``: ``kernel`` in the op's call form, in ``tiles``."""
    fn = on_halves(kernel.fn) if op == "silu_mul" else kernel.fn
    return row_tiled(fn, tiles)


# -- the start-up check ---------------------------------------------------------------------


def tile_sets(largest: int) -> list[tuple[int, ...]]:
    """The tile sets tried, least padding first: every power of two up to ``largest``, then
    without the smallest, and so on (libraries often run one row, or a few, through paths of
    their own: torch's bf16 GEMM runs one row as a gemv on some CPUs)."""
    pow2 = tuple(2**i for i in range(largest.bit_length()))
    return [pow2[i:] for i in range(len(pow2))]
