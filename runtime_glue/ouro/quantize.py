"""``--quantization``: a loaded checkpoint's projections in a weight-only scheme (``hal.quant``).

Quantized: every layer's q|k|v, o, gate|up and down projections (lm_head only when asked).
The embedding (a row gather), the exit gate (one output) and the norms stay bf16. A stacked
projection (``checkpoint.STACKED``) is quantized once and its members are row slices of it,
so a column-invariant kernel still makes one call for q|k|v. Everything (packed weights,
scales, the bf16 tensors kept) is copied into one new buffer from ``Device.alloc_weights``, and
the checkpoint's is freed: the weights take their quantized bytes, placed as bf16 ones are.

:func:`dequantized` gives the weights as the HF reference takes them: the oracle of a
quantized model is the reference run on its dequantized weights (``hal.quant``).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from hal.interfaces import Device
from hal.quant import GROUPED, QuantizedWeight, check_scheme, describe, quantize
from runtime_glue.ouro.checkpoint import STACKED, expected_tensors
from runtime_glue.ouro.config import OuroConfig

LONE = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
INPUT_WIDTHS = ("hidden_size", "intermediate_size")  # the K of every quantized projection


def check_quantization(
    cfg: OuroConfig, scheme: str | None, group_size: int, activations: bool = False
) -> str | None:
    """Why ``scheme`` cannot quantize this model's projections (None if it can): checked
    from config.json, before the weights load."""
    if scheme is None:
        if activations:
            return "--quantize-activations needs --quantization (int8, int8g or int4 weights)"
        return None
    try:
        check_scheme(scheme, group_size)
    except ValueError as exc:
        return str(exc)
    if scheme in GROUPED:
        for name in INPUT_WIDTHS:
            k = getattr(cfg, name)
            if scheme == "int4" and k % 32:
                return (
                    f"--quantization int4: the model's {name} ({k}) is not a multiple of 32, "
                    "and int4 packs a projection's inputs 32 at a time; use --quantization int8"
                )
            if k % group_size:
                return (
                    f"--quantization-group-size {group_size}: the model's {name} ({k}) is not "
                    "a multiple of it; choose a group size that divides it (32, 64 or 128)"
                )
    return None


def quantize_weights(
    weights: dict[str, torch.Tensor],
    cfg: OuroConfig,
    scheme: str,
    group_size: int,
    lm_head: bool = False,
    device: Device | None = None,
) -> dict[str, Any]:
    """``weights`` (``checkpoint.load_weights``) with the projections in ``scheme``, every
    tensor (packed weights, scales, the bf16 ones kept) in one buffer from
    ``device.alloc_weights`` (aligned, huge pages on cpu), as the loader places bf16 weights."""
    projections = {m for members in STACKED.values() for m in members} | set(LONE)

    def quantized(name: str) -> bool:
        return name.split(".", 3)[-1] in projections or (lm_head and name == "lm_head.weight")

    own = checkpoint_tensors(weights)
    return place(
        {n: quantize(w, scheme, group_size) if quantized(n) else w for n, w in own.items()},
        cfg,
        device,
    )


def place(weights: dict[str, Any], cfg: OuroConfig, device: Device | None) -> dict[str, Any]:
    """A checkpoint's tensors (bf16 or ``QuantizedWeight``, wherever they are) copied into one
    buffer from ``device.alloc_weights``, each layer's stacked projection (``STACKED``) once
    with its members as row slices of it, so a column-invariant kernel still makes one call
    for q|k|v (a quantization is per row: stacking the members' is quantizing the stack).
    Consumes ``weights``: each member is let go once stacked, so the peak is the tensors
    once and the buffer."""
    owners: dict[str, Any] = {}
    members: dict[str, tuple[str, int, int]] = {}  # a stacked member: (its stack, rows)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for stacked, names in STACKED.items():
            parts = [weights.pop(p + m) for m in names]
            owners[p + stacked] = _stack(parts)
            start = 0
            for member, part in zip(names, parts, strict=True):
                members[p + member] = (p + stacked, start, start + part.shape[0])
                start += part.shape[0]
    owners.update(weights)
    weights.clear()
    out = _in_one_buffer(owners, device)
    for name, (stacked, start, stop) in members.items():
        w = out[stacked]
        out[name] = w.rows(start, stop) if isinstance(w, QuantizedWeight) else w[start:stop]
    return out


def _stack(parts: list[Any]) -> Any:
    """Row-wise concatenation of tensors, or of quantized weights of one scheme and group."""
    if not isinstance(parts[0], QuantizedWeight):
        return torch.cat(parts)
    return attrs.evolve(
        parts[0],
        qweight=torch.cat([w.qweight for w in parts]),
        scale=torch.cat([w.scale for w in parts]),
        forms={},
    )


def expected_weight_bytes(
    cfg: OuroConfig, scheme: str | None = None, group_size: int = 32, lm_head: bool = False
) -> int:
    """What :func:`weight_bytes` will count once the weights are loaded (and quantized in
    ``scheme``), from config.json alone: ``--memory-budget`` is checked before a weight is
    read. bf16 tensors 2 bytes an element; a quantized projection its packed weight (int8: one
    byte an element, int4: half) and its bf16 scales (int8: one a row, int4: one a group)."""
    projections = {m for members in STACKED.values() for m in members} | set(LONE)
    total = 0
    for name, shape in expected_tensors(cfg).items():
        quantized = name.split(".", 3)[-1] in projections or (lm_head and name == "lm_head.weight")
        if scheme is None or not quantized:
            total += 2 * math.prod(shape)
            continue
        rows, k = shape
        if scheme == "int8":
            total += rows * k + 2 * rows
        else:
            total += rows * k // (2 if scheme == "int4" else 1) + 2 * rows * (k // group_size)
    return total


_ALIGN = 64  # bytes between tensors in the buffer


def _in_one_buffer(tensors: dict[str, Any], device: Device | None) -> dict[str, Any]:
    """Every tensor (and every QuantizedWeight's two) copied into one byte buffer."""

    def parts(t):
        return t.parts() if isinstance(t, QuantizedWeight) else (t,)

    flat = [x for t in tensors.values() for x in parts(t)]
    offsets, total = [], 0
    for x in flat:
        offsets.append(total)
        total = -(-(total + x.nbytes) // _ALIGN) * _ALIGN
    if device is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=flat[0].device)
    else:
        buffer = device.alloc_weights(total, torch.uint8)
    placed = iter(
        buffer[at : at + x.nbytes].view(x.dtype).view(x.shape).copy_(x)
        for at, x in zip(offsets, flat, strict=True)
    )
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if isinstance(t, QuantizedWeight):
            out[name] = attrs.evolve(t, qweight=next(placed), scale=next(placed), forms={})
        else:
            out[name] = next(placed)
    return out


def checkpoint_tensors(weights: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's own tensors: the stacked views (``checkpoint.STACKED``) left out."""
    return {n: w for n, w in weights.items() if n.split(".", 3)[-1] not in STACKED}


def dequantized(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor in bf16, the quantized ones dequantized: the weights the HF
    reference takes (a checkpoint quantized elsewhere holds no bf16 projections to read)."""
    own = checkpoint_tensors(weights).items()
    return {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in own}


def weight_bytes(weights: dict[str, Any]) -> int:
    """The bytes the model's weights take (a stacked projection counted once, by its
    members)."""
    return sum(w.nbytes for w in checkpoint_tensors(weights).values())


def weights_label(weights: dict, activations: bool = False) -> str:
    """How the plan names the model's weights: "bf16", "int8", "int4 (group 32)", with
    " + lm_head" where lm_head is quantized too and " + int8 activations" where kernels may
    quantize their activations (``--quantize-activations``)."""
    w = weights["model.layers.0.mlp.down_proj.weight"]
    if not isinstance(w, QuantizedWeight):
        return "bf16"
    head = " + lm_head" if isinstance(weights["lm_head.weight"], QuantizedWeight) else ""
    return describe(w.scheme, w.group_size) + head + (" + int8 activations" if activations else "")
