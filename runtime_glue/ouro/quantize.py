"""``--quantization``: a loaded checkpoint's projections in a weight-only scheme (``hal.quant``).

Quantized: every layer's q|k|v, o, gate|up and down projections (lm_head only when asked).
The embedding (a row gather), the exit gate (one output) and the norms stay bf16. A stacked
projection (``checkpoint.STACKED``) is quantized once and its members are row slices of it,
so a column-invariant kernel still makes one call for q|k|v. The bf16 tensors kept are copied
out of the checkpoint's buffer, which is then freed: the weights take their quantized bytes.

:func:`dequantized` gives the weights as the HF reference takes them: the oracle of a
quantized model is the reference run on its dequantized weights (``hal.quant``).
"""

from __future__ import annotations

from typing import Any

import torch

from hal.quant import QuantizedWeight, check_scheme, describe, quantize
from runtime_glue.ouro.checkpoint import STACKED
from runtime_glue.ouro.config import OuroConfig

LONE = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
INPUT_WIDTHS = ("hidden_size", "intermediate_size")  # the K of every quantized projection


def check_quantization(cfg: OuroConfig, scheme: str | None, group_size: int) -> str | None:
    """Why ``scheme`` cannot quantize this model's projections (None if it can): checked
    from config.json, before the weights load."""
    if scheme is None:
        return None
    try:
        check_scheme(scheme, group_size)
    except ValueError as exc:
        return str(exc)
    if scheme == "int4":
        for name in INPUT_WIDTHS:
            k = getattr(cfg, name)
            if k % 32:
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
) -> dict[str, Any]:
    """``weights`` (``checkpoint.load_weights``) with the projections in ``scheme``."""
    out: dict[str, Any] = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for stacked, members in STACKED.items():
            qw = quantize(weights[p + stacked], scheme, group_size)
            out[p + stacked] = qw
            start = 0
            for member in members:
                rows = weights[p + member].shape[0]
                out[p + member] = qw.rows(start, start + rows)
                start += rows
        for name in LONE:
            out[p + name] = quantize(weights[p + name], scheme, group_size)
    if lm_head:
        out["lm_head.weight"] = quantize(weights["lm_head.weight"], scheme, group_size)
    copies: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    for name, w in weights.items():
        if name not in out:  # kept bf16: its own memory, not a view of the checkpoint buffer
            key = (w.data_ptr(), tuple(w.shape))
            out[name] = copies.setdefault(key, w.clone())
    return out


def dequantized(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each quantized checkpoint tensor (stacked views excluded), dequantized to bf16."""
    stacked = set(STACKED)
    return {
        name: w.dequantize()
        for name, w in weights.items()
        if isinstance(w, QuantizedWeight) and name.split(".", 3)[-1] not in stacked
    }


def weight_bytes(weights: dict[str, Any]) -> int:
    """The bytes the model's weights take (stacked views counted once, by their members)."""
    stacked = set(STACKED)
    total = 0
    for name, w in weights.items():
        if name.split(".", 3)[-1] in stacked:
            continue
        total += w.nbytes
    return total


def weights_label(weights: dict) -> str:
    """How the plan names the model's weights: "bf16", "int8", "int4 (group 32)", and
    "+ lm_head" where lm_head is quantized too."""
    w = weights["model.layers.0.mlp.down_proj.weight"]
    if not isinstance(w, QuantizedWeight):
        return "bf16"
    head = isinstance(weights["lm_head.weight"], QuantizedWeight)
    return describe(w.scheme, w.group_size) + (" + lm_head" if head else "")
