"""Kernels as values: the implementations a driver offers for each op, and what each claims.

Attention backends are objects with declared properties; projection, norm and activation
kernels are the same idea in a smaller form. A driver offers a tuple of :class:`Kernel`
values; every driver also offers torch's own forms (``TORCH_KERNELS``), which are Hugging
Face's arithmetic and therefore HF-exact. The runtime's execution plan chooses among them;
the conformance kit checks every offered kernel against float64 and every claim it makes.

Ops and their call signatures:

- ``linear``: ``fn(x [..., K], w [N, K]) -> [..., N]`` (no bias); a quantized kernel takes
  a ``hal.quant.QuantizedWeight`` as ``w`` (``Kernel.scheme``).
- ``rms_norm``: ``fn(x [..., H], weight [H], eps) -> [..., H]``: HF's RMSNorm.
- ``silu_mul``: ``fn(gate [M, I], up [M, I]) -> [M, I]``: the MLP's ``silu(gate) * up``.
  ``gate`` and ``up`` may be views with the same row stride (halves of a stacked
  gate|up projection).
- ``add_rms_norm``: ``fn(x [..., H], residual [..., H], weight [H], eps) -> (normed, sum)``:
  ``sum = residual + x`` (rounded to the dtype), ``normed = rms_norm(sum)``: a residual add
  followed by a norm, as a fused kernel takes them.
- ``rotary``: ``fn(q [N, Hq, d], k [N, Hk, d], cos [N, d], sin [N, d]) -> (q', k')``: NeoX
  rotary (``x * cos + rotate_half(x) * sin``) of one step's queries and keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

OPS = ("linear", "rms_norm", "silu_mul", "add_rms_norm", "rotary")
WEIGHT_SCHEMES = ("bf16", "int8", "int8g", "int4", "int8z")  # "bf16", then hal.quant.SCHEMES


class KernelUnavailable(RuntimeError):
    """A kernel that cannot run here; the message says what to install or choose instead."""


def _always_available() -> None:
    return None


@attrs.frozen
class Kernel:
    """One implementation of one op.

    Claims (each verified by the conformance kit; deterministic mode also verifies, at start-up,
    every call shape it will issue, whatever is claimed):

    - ``hf_exact``: the bits of Hugging Face's torch form for the same call.
    - ``row_invariant``: a row's bits do not depend on the call's other rows, their number, or
      the row's place among them, for any row count (by construction, not by measurement).
    - ``column_invariant`` (linear): each output column is computed alone, so one call on
      stacked weights (q|k|v) gives the bits of separate calls.

    ``scheme`` (linear): the weights it takes: "bf16" (a tensor ``[N, K]``), or a quantized
    scheme of ``hal.quant`` (a ``QuantizedWeight``). ``activations``: "int8" for a kernel that
    quantizes its inputs per block of 32 as llama.cpp does (its arithmetic is W8A8 / W4A8),
    "int8-token" for one that quantizes each row with one scale as vllm-ascend's W8A8 dynamic
    does (``npu_dynamic_quant``), "int8-static" for one that quantizes them with the weight's
    calibrated per-tensor scale and offset (``hal.quant.StaticInput``, W8A8 static, vllm-ascend's
    ``npu_quantize`` + ``npu_quant_matmul``); the conformance kit checks each against a
    reference of its arithmetic (``hal.quant.quantize_activations``).

    ``fast_only``: a fused kernel that only ``--mode fast`` may use, and only once a check on
    the device has admitted it (no other mode ever chooses it).

    ``check()`` raises :class:`KernelUnavailable` when the kernel cannot run here (a missing
    compiler, an instruction set this CPU lacks); it may build the kernel on first use.

    ``into`` (optional): the kernel bound once to its constant operands, for a caller that
    owns its buffers (``runtime_glue.ouro.bound_loop``). ``into(*consts)`` checks them and
    returns ``call(out, x)``, which writes ``fn(x, *consts)`` for every row of ``x`` into the
    first rows of ``out``, with the same bits and no checks or allocation of its own (linear:
    ``into(weight)``; rms_norm: ``into(weight, eps)``; silu_mul: ``into()``, then
    ``call(out, gate_up)`` on the halves of gate|up rows; rotary: ``into()``, then
    ``call((q_out, k_out), q, k, cos, sin)``). Both tensors are 2-D with contiguous rows (rotary:
    ``fn``'s shapes).
    """

    op: str = attrs.field(validator=attrs.validators.in_(OPS))
    name: str
    fn: Callable[..., Any]  # a tensor (add_rms_norm and rotary: a pair)
    hf_exact: bool = False
    row_invariant: bool = False
    column_invariant: bool = False
    fast_only: bool = False
    scheme: str = attrs.field(default="bf16", validator=attrs.validators.in_(WEIGHT_SCHEMES))
    # A quantized linear's activations: "bf16" as given, "int8": quantized per block of 32, or
    # "int8-token": one scale a row, "int8-static": the weight's calibrated scale and offset
    # (hal.quant.quantize_activations), before integer dot products (W8A8 / W4A8).
    activations: str = attrs.field(
        default="bf16",
        validator=attrs.validators.in_(("bf16", "int8", "int8-token", "int8-static")),
    )
    check: Callable[[], None] = _always_available
    description: str = ""
    # Changes whenever the kernel's code does: it keys the execution plan's cached timings.
    version: str = ""
    into: Callable[..., Callable[..., None]] | None = None

    def available(self) -> str | None:
        """None when the kernel can run here, else why not."""
        try:
            self.check()
        except KernelUnavailable as exc:
            return str(exc)
        return None


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: statistics in fp32, cast back, then ``weight * x`` in bf16."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def hf_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF LlamaMLP's activation: ``silu(gate)`` rounded to the dtype, then times ``up``."""
    return F.silu(gate) * up


def hf_add_rms_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's residual add (``h = h + x``), then its RMSNorm of the sum."""
    total = residual + x
    return hf_rms_norm(total, weight, eps), total


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half`` (NeoX): ``[-x2, x1]`` along the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rotary(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` on ``[N, heads, d]`` queries and keys (bf16 throughout)."""
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, d]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


TORCH_KERNELS = (
    Kernel("linear", "torch", F.linear, hf_exact=True, description="F.linear"),
    Kernel("rms_norm", "torch", hf_rms_norm, hf_exact=True, description="HF's torch form"),
    Kernel("silu_mul", "torch", hf_silu_mul, hf_exact=True, description="F.silu(gate) * up"),
    Kernel("add_rms_norm", "torch", hf_add_rms_norm, hf_exact=True, description="add, HF norm"),
    Kernel("rotary", "torch", hf_rotary, hf_exact=True, description="HF apply_rotary_pos_emb"),
)


# -- checking a claim of row invariance ------------------------------------------------------


def adversarial_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights ``[n, k]`` for :func:`adversarial_rows`: values near 1 (``a[n] + 1.37 * b[k]``,
    all different, and cheap to draw for a 49152 x 2048 lm_head), except up to 16 column
    pairs where each weight row holds one value +-2^12 twice."""
    w = (torch.randn(n, 1, generator=gen) + 1.37 * torch.randn(1, k, generator=gen)).bfloat16()
    sign = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(torch.bfloat16) * 2.0**12
    for a, b in _big_columns(k):
        w[:, a] = w[:, b] = sign
    return w


def adversarial_rows(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs whose products with :func:`adversarial_weight` include pairs of +-2^24 that
    cancel exactly, among terms near 1: each row switches on its own four of the weight's big
    column pairs (zeros at the others). A sum that meets one of a pair before its partner
    absorbs the small terms it adds in between, so two summation orders that group the terms
    differently give visibly different bits. Products of bf16 values are exact in fp32, so
    the order is all that can differ."""
    x = torch.empty(rows, k, dtype=torch.bfloat16).normal_(generator=gen)
    pairs = torch.tensor(_big_columns(k), dtype=torch.int64).view(-1, 2)
    x[:, pairs.flatten()] = 0
    for r in range(rows):
        on = pairs[torch.randperm(len(pairs), generator=gen)[:4]]
        sign = (torch.randint(0, 2, (len(on),), generator=gen) * 2 - 1).to(torch.bfloat16)
        x[r, on[:, 0]], x[r, on[:, 1]] = sign * 2.0**12, -sign * 2.0**12
    return x


def _big_columns(k: int) -> list[list[int]]:
    """The weight's big column pairs for width ``k``: up to 16, at positions drawn once."""
    pairs = min(16, k // 4)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    return order[: 2 * pairs].view(pairs, 2).tolist()


def check_rows(apply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles) -> str | None:
    """None if ``apply`` gives every row of ``x`` the same bits in a call of each row count
    in ``tiles`` (ascending), at every position, beside other rows or zero padding; else what
    differed.

    ``x`` needs ``2 * tiles[-1]`` rows; with :func:`adversarial_rows` (and the weight of
    :func:`adversarial_weight`), any difference in summation order shows. ``apply`` must be
    the exact call form a runtime issues (contiguous, 64-byte-aligned inputs).
    """
    big = tiles[-1]
    ref = apply(x[:big].clone())
    shift = big // 2 + 1
    if big > 1 and not torch.equal(apply(x[:big].roll(shift, 0).clone()), ref.roll(shift, 0)):
        return f"a row moved within a {big}-row call changed its bits"
    for t in tiles[:-1]:
        at = (big - t) // 2
        if not torch.equal(apply(x[at : at + t].clone()), ref[at : at + t]):
            return f"rows in a {t}-row call differ from the same rows in a {big}-row call"
        padded = torch.cat((x[at : at + t - 1], torch.zeros_like(x[:1])))
        if not torch.equal(apply(padded)[: t - 1], ref[at : at + t - 1]):
            return f"rows in a zero-padded {t}-row call differ from a {big}-row call"
    other = torch.cat((x[big + 1 : 2 * big], x[:1]))  # row 0 last, among rows it never met
    if not torch.equal(apply(other)[big - 1 :], ref[:1]):
        return f"a row beside other rows in a {big}-row call changed its bits"
    return None
