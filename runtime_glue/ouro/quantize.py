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
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hal.interfaces import Device
from hal.quant import (
    GROUPED,
    QuantizedWeight,
    StaticInput,
    check_scheme,
    describe,
    layout,
    quantize,
)
from runtime_glue.ouro.checkpoint import STACKED, expected_tensors
from runtime_glue.ouro.config import OuroConfig

LONE = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
INPUT_WIDTHS = ("hidden_size", "intermediate_size")  # the K of every quantized projection


def check_quantization(
    cfg: OuroConfig, scheme: str | None, group_size: int, activations: str | None = None
) -> str | None:
    """Why ``scheme`` (and ``activations``, ``--quantize-activations``) cannot quantize this
    model's projections (None if they can): checked from config.json, before the weights
    load."""
    if scheme is None:
        if activations not in (None, "none"):
            return "--quantize-activations needs --quantization (int8, int8g or int4 weights)"
        return None
    if activations == "token" and scheme != "int8":
        return (
            f"--quantize-activations token (W8A8 dynamic, as vllm-ascend's) takes int8 weights "
            f"with one scale per channel, and --quantization is {scheme}: use --quantization "
            "int8, or --quantize-activations block"
        )
    if activations == "static" and scheme != "int8":
        return (
            f"--quantize-activations static (W8A8 static) takes int8 weights per channel, and "
            f"--quantization is {scheme}"
        )
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

    def made(name: str) -> Any:
        w = weights[name]
        return quantize(w, scheme, group_size) if quantized(name, lm_head) else w

    return place(cfg, scheme, group_size, lm_head, made, device)


def quantized(name: str, lm_head: bool) -> bool:
    """Whether a checkpoint tensor is quantized: every projection, lm_head if asked."""
    return name.split(".", 3)[-1] in PROJECTIONS or (lm_head and name == "lm_head.weight")


PROJECTIONS = {m for members in STACKED.values() for m in members} | set(LONE)


def _owners(
    cfg: OuroConfig, scheme: str | None, group_size: int | None, lm_head: bool
) -> tuple[dict[str, tuple], dict[str, tuple[str, int, int]]]:
    """Where every tensor lives, from config.json: each owner (a stacked projection, or a
    checkpoint tensor not stacked) with the (shape, dtype) of its parts (a quantized one's
    packed weight and scales; a bf16 tensor itself), and each stacked member's (stack, rows)."""
    shapes = expected_tensors(cfg)
    owners: dict[str, tuple] = {}
    members: dict[str, tuple[str, int, int]] = {}

    def parts(name: str, rows: int, k: int) -> tuple:
        if scheme is None or not quantized(name, lm_head):
            return (((rows, k), torch.bfloat16),)
        return layout(scheme, rows, k, group_size)

    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for stacked, names in STACKED.items():
            start = 0
            for member in names:
                rows = shapes[p + member][0]
                members[p + member] = (p + stacked, start, start + rows)
                start += rows
            owners[p + stacked] = parts(p + names[0], start, shapes[p + names[0]][1])
    for name, shape in shapes.items():
        if name not in members:
            owners[name] = parts(name, *shape) if len(shape) == 2 else (((shape), torch.bfloat16),)
    return owners, members


def place(
    cfg: OuroConfig,
    scheme: str | None,
    group_size: int | None,
    lm_head: bool,
    made: Callable[[str], Any],
    device: Device | None,
) -> dict[str, Any]:
    """The model's weights in one buffer from ``device.alloc_weights``, laid out from
    config.json before any is made: ``made(name)`` gives each checkpoint tensor (bf16, or a
    ``QuantizedWeight`` in ``scheme``), which is copied into its place at once, so the peak is
    the buffer and one tensor. Each layer's stacked projection (``STACKED``) is one owner with
    its members as row slices of it, so a column-invariant kernel still makes one call for
    q|k|v (a quantization is per row: stacking the members' is quantizing the stack)."""
    owners, members = _owners(cfg, scheme, group_size, lm_head)
    views = _buffer(owners, device)
    out: dict[str, Any] = {}
    statics: dict[str, StaticInput] = {}  # W8A8 static: each tensor's calibrated input
    for name, parts in views.items():
        if len(parts) == 2:
            assert scheme is not None  # only a quantized owner has two parts
            k = _in_features(owners[name], scheme, group_size)
            group = k if scheme == "int8" else group_size
            assert group is not None
            out[name] = QuantizedWeight(scheme, parts[0], parts[1], group, k)
        else:
            out[name] = parts[0]
    for name in expected_tensors(cfg):
        if name in members:
            stacked, start, stop = members[name]
            target = out[stacked]
            target = (
                target.rows(start, stop)
                if isinstance(target, QuantizedWeight)
                else target[start:stop]
            )
        else:
            target = out[name]
        value = made(name)
        if isinstance(target, QuantizedWeight):
            same = isinstance(value, QuantizedWeight) and (
                value.scheme,
                value.group_size,
                value.shape,
            ) == (target.scheme, target.group_size, target.shape)
            if not same:
                raise ValueError(
                    f"{name}: expected a {describe(scheme, group_size)} weight {list(target.shape)}"
                )
            target.qweight.copy_(value.qweight)
            target.scale.copy_(value.scale.view(target.scale.shape))
            if value.static is not None:
                statics[name] = value.static
        else:
            target.copy_(value)
        del value
    if statics:
        _attach_statics(out, members, statics)
    for name, (stacked, start, stop) in members.items():
        w = out[stacked]
        out[name] = w.rows(start, stop) if isinstance(w, QuantizedWeight) else w[start:stop]
    return out


def _attach_statics(
    out: dict[str, Any], members: dict[str, tuple[str, int, int]], statics: dict[str, StaticInput]
) -> None:
    """Each quantized owner of ``out`` with its members' calibrated inputs (W8A8 static): a
    stacked projection's members take one input, so their scale and offset must agree; their
    biases and dequantization scales are stacked as their rows are."""
    parts: dict[str, list[str]] = {}
    for name in statics:
        parts.setdefault(members[name][0] if name in members else name, []).append(name)
    for owner, names in parts.items():
        names.sort(key=lambda n: members[n][1] if n in members else 0)
        first = statics[names[0]]
        for name in names[1:]:
            st = statics[name]
            if not (torch.equal(st.scale, first.scale) and torch.equal(st.offset, first.offset)):
                raise ValueError(
                    f"{name}: input_scale / input_offset {float(st.scale[0])} / "
                    f"{float(st.offset[0])} differ from {names[0]}'s {float(first.scale[0])} / "
                    f"{float(first.offset[0])}: the stacked projections take one input"
                )
        w = out[owner]
        device = w.device
        static = StaticInput(
            first.scale.to(device),
            first.offset.to(device),
            torch.cat([statics[n].bias for n in names]).to(device),
            torch.cat([statics[n].deq_scale for n in names]).to(device),
        )
        if static.bias.shape[0] != w.shape[0]:
            raise ValueError(f"{owner}: a W8A8 static weight has no calibrated input")
        out[owner] = attrs.evolve(w, static=static, forms={})


def _in_features(parts: tuple, scheme: str, group_size: int | None) -> int:
    (qshape, _), _ = parts
    if scheme == "int8z":  # K values and K / group zero points a row
        assert group_size is not None
        return qshape[1] * group_size // (group_size + 1)
    return qshape[1] * 2 if scheme == "int4" else qshape[1]


def expected_weight_bytes(
    cfg: OuroConfig, scheme: str | None = None, group_size: int = 32, lm_head: bool = False
) -> int:
    """What :func:`weight_bytes` will count once the weights are loaded (and quantized in
    ``scheme``), from config.json alone: ``--memory-budget`` is checked before a weight is
    read. The parts :func:`place` lays out, without the alignment between them."""
    owners, _ = _owners(cfg, scheme, group_size, lm_head)
    return sum(
        math.prod(shape) * dtype.itemsize for parts in owners.values() for shape, dtype in parts
    )


_ALIGN = 64  # bytes between tensors in the buffer


def _buffer(owners: dict[str, tuple], device: Device | None) -> dict[str, list[torch.Tensor]]:
    """One byte buffer from ``device.alloc_weights`` (a host tensor without a device) holding
    each owner's parts, aligned: their views."""
    offsets, total = [], 0
    flat = [(name, shape, dtype) for name, parts in owners.items() for shape, dtype in parts]
    for _, shape, dtype in flat:
        offsets.append(total)
        total = -(-(total + math.prod(shape) * dtype.itemsize) // _ALIGN) * _ALIGN
    if device is None:
        buffer = torch.empty(total, dtype=torch.uint8)
    else:
        buffer = device.alloc_weights(total, torch.uint8)
    views: dict[str, list[torch.Tensor]] = {name: [] for name in owners}
    for at, (name, shape, dtype) in zip(offsets, flat, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        views[name].append(buffer[at : at + nbytes].view(dtype).view(shape))
    return views


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


ACTIVATION_LABELS = {
    "block": " + int8 activations",
    "token": " + int8 activations per token",
    "static": " + int8 activations, static",
}


def weights_label(weights: dict, activations: str | None = None) -> str:
    """How the plan names the model's weights: "bf16", "int8", "int4 (group 32)", with
    " + lm_head" where lm_head is quantized too and " + int8 activations" where kernels may
    quantize their activations per block (``--quantize-activations``), " + int8 activations
    per token" where they do per token."""
    w = weights["model.layers.0.mlp.down_proj.weight"]
    if not isinstance(w, QuantizedWeight):
        return "bf16"
    head = " + lm_head" if isinstance(weights["lm_head.weight"], QuantizedWeight) else ""
    return describe(w.scheme, w.group_size) + head + ACTIVATION_LABELS.get(activations or "", "")
