"""Quantized checkpoints made by Huawei's msModelSlim for Ascend (vllm-ascend's ``--quantization
ascend``): a ``quant_model_description.json`` beside the safetensors maps every tensor to its
layer's type ("W8A16", "W8A8_DYNAMIC", ..., "FLOAT" for one kept in floating point), and
``config.json`` carries no ``quantization_config`` (msModelSlim removes it).

A quantized Linear module ``M`` holds (msModelSlim's AscendV1 saver, as vllm-ascend's
``w8a16.py`` and ``w8a8_dynamic.py`` read them):

- ``M.weight``: int8 ``[N, K]``;
- ``M.weight_scale``: ``[N, 1]`` (W8A16 per group: ``[N, K / group_size]``, the description's
  ``group_size``), stored in float32 and loaded into a bf16 model's parameters as vllm-ascend
  does: rounded to bf16;
- ``M.weight_offset``: the same shape; zeros for W8A8_DYNAMIC (the saver writes zeros) and for
  a symmetric W8A16. An asymmetric W8A16 (a nonzero offset anywhere) has the value ``(q +
  offset) * scale`` (``npu_weight_quant_batchmatmul``'s ``antiquant_offset``, as vllm-ascend
  passes it): it runs as ``hal.quant``'s int8z with ``z = -offset`` (integers in [-127, 128]).

Arithmetic: W8A16 is ``x @ (q * scale).T`` (``hal.quant``'s int8, or int8g per group); W8A8
dynamic quantizes each row of ``x`` with one scale (``torch_npu.npu_dynamic_quant``) and sums
integer products (``npu_quant_matmul`` with per-channel and per-token scales):
``hal.quant.token_linear``, what ``--quantize-activations token`` runs. W8A8 (static) also
holds ``M.input_scale`` and ``M.input_offset`` (``(1,)``: the input's calibrated scale and
integer offset), ``M.quant_bias`` (int32 ``[N]``: ``-offset * sum_k q``) and ``M.deq_scale``
(fp32 ``[N]``: ``input_scale * weight_scale``; a float16 model's int64 holds its bits), as
vllm-ascend's ``w8a8_static`` reads them: the input quantized with the scale and offset
(``npu_quantize``), the integer sums plus ``quant_bias`` times ``deq_scale``
(``npu_quant_matmul``): ``hal.quant.static_linear``, ``--quantize-activations static``.
Every projection of every layer must have the same type; everything else (embedding, norms,
the exit gate, lm_head) must be "FLOAT". The other types are refused by name before a weight
loads.

:func:`write` makes such checkpoints from rlt-hal's own int8 quantization (``rlt-hal
quantize --format msmodelslim``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from hal.interfaces import Device
from hal.quant import QuantizedWeight, StaticInput, from_integers
from runtime_glue.ouro.checkpoint import (
    CheckpointError,
    TensorEntry,
    expected_tensors,
    index_checkpoint,
    read_tensor,
)
from runtime_glue.ouro.compressed import CheckpointQuantization, kernel_group, load_stored
from runtime_glue.ouro.compressed_write import write_beside
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.quantize import checkpoint_tensors

METHOD = "msModelSlim"
DESCRIPTION = "quant_model_description.json"
WEIGHTS_FILE = "quant_model_weights.safetensors"  # the AscendV1 saver's name
STATIC = "W8A8"  # W8A8 static: the input's scale and offset calibrated, per tensor
TYPES = ("W8A16", "W8A8_DYNAMIC", STATIC)  # what rlt-hal runs
WHAT_WORKS = (
    "rlt-hal loads msModelSlim W8A16 (per channel or group, symmetric or asymmetric), "
    "W8A8_DYNAMIC and W8A8 (static) checkpoints (symmetric: zero weight_offset) with every "
    "projection of one type"
)
ACTIVATIONS = {"W8A8_DYNAMIC": "token", STATIC: "static"}


def is_msmodelslim(model_dir: str | Path) -> bool:
    """Whether the checkpoint is msModelSlim's (its description beside it, whatever
    config.json says: vllm-ascend detects it so)."""
    return (Path(model_dir) / DESCRIPTION).is_file()


def read_quantization(model_dir: str | Path, cfg: OuroConfig) -> CheckpointQuantization:
    """The checkpoint's quantization from its description alone; a type rlt-hal does not run is
    a one-line error naming it, the file and what works."""
    path = Path(model_dir) / DESCRIPTION
    try:
        description = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(description, dict):
        raise CheckpointError(f"{path}: is not a JSON object of tensor names and types")

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; {WHAT_WORKS}")

    types: dict[str, str] = {}
    for name in expected_tensors(cfg):
        if not name.endswith(".weight"):
            continue
        if name not in description:
            raise refuse(f"has no entry for {name!r} (every Linear's weight needs one)")
        types[name] = str(description[name])
    projections = [n for n in types if n.endswith("_proj.weight")]
    kind = types[projections[0]]
    if kind not in TYPES:
        raise refuse(f"{projections[0]!r} is {kind}, which is not supported")
    other = next((n for n in projections if types[n] != kind), None)
    if other is not None:
        raise refuse(
            f"{other!r} is {types[other]} and {projections[0]!r} {kind}: rlt-hal runs every "
            "layer's projections in one scheme"
        )
    kept = next((n for n in types if n not in projections and types[n] != "FLOAT"), None)
    if kept is not None:
        raise refuse(f"{kept!r} is {types[kept]}; only the layers' projections may be quantized")
    group = int(description.get("group_size") or 0)
    widths = (cfg.hidden_size, cfg.intermediate_size)
    if kind == "W8A16" and _asymmetric(model_dir, projections):
        # (q + weight_offset) * scale: int8z with z = -offset, a group of the kernels' (per
        # channel: each scale and offset repeated per group)
        kernels = kernel_group(group or None, widths)
        if kernels is None:
            raise refuse(
                f"group_size {group} on input widths {widths}: the kernels need groups of 32, "
                "64 or 128 dividing them"
            )
        return CheckpointQuantization(
            kind, "int8z", kernels, group or None, False, False, method=METHOD, zero_points=True
        )
    if group and kind == "W8A16":
        kernels = kernel_group(group, widths)
        if kernels is None:
            raise refuse(
                f"group_size {group} on input widths {widths}: the kernels need groups of 32, "
                "64 or 128 dividing them"
            )
        return CheckpointQuantization(kind, "int8g", kernels, group, False, False, method=METHOD)
    return CheckpointQuantization(
        kind,
        "int8",
        None,
        None,
        False,
        False,
        method=METHOD,
        activations=ACTIVATIONS.get(kind),
    )


def _asymmetric(model_dir: str | Path, projections: list[str]) -> bool:
    """Whether any projection's ``weight_offset`` is nonzero (read before the weights: the
    offsets are one value a channel or group)."""
    entries = index_checkpoint(model_dir)
    for name in projections:
        entry = entries.get(name[: -len(".weight")] + ".weight_offset")
        if entry is not None and bool(read_tensor(entry).ne(0).any()):
            return True
    return False


def expected(cfg: OuroConfig, cq: CheckpointQuantization) -> dict[str, tuple[tuple, tuple]]:
    """Name -> (shape, allowed safetensors dtypes) of every tensor the checkpoint holds."""
    out: dict[str, tuple[tuple, tuple]] = {}
    scale_dtypes = ("F32", "BF16", "F16")
    for name, shape in expected_tensors(cfg).items():
        module = name.rsplit(".", 1)[0]
        if not name.endswith("_proj.weight"):
            out[name] = (shape, ("BF16",))
            continue
        n, k = shape
        scales = (n, 1 if cq.stored_group is None else k // cq.stored_group)
        out[name] = ((n, k), ("I8",))
        out[module + ".weight_scale"] = (scales, scale_dtypes)
        out[module + ".weight_offset"] = (scales, scale_dtypes)
        if cq.format == STATIC:
            out[module + ".input_scale"] = ((1,), scale_dtypes)
            out[module + ".input_offset"] = ((1,), (*scale_dtypes, "I8"))
            out[module + ".quant_bias"] = ((n,), ("I32",))
            out[module + ".deq_scale"] = ((n,), ("F32", "I64"))  # I64: a float16 model's
    return out


def load(
    model_dir: str | Path,
    cfg: OuroConfig,
    cq: CheckpointQuantization,
    device: Device,
    progress: bool = False,
) -> dict[str, Any]:
    """The checkpoint's weights in ``hal.quant``'s layout (int8 or int8g projections, the
    rest bf16), in one buffer from ``device.alloc_weights``, one tensor read at a time."""

    def quantized(entries: dict[str, TensorEntry], name: str, shape: tuple) -> Any:
        if not name.endswith("_proj.weight"):
            return None
        return _quantized_weight(entries, name[: -len(".weight")], shape, cq)

    return load_stored(model_dir, cfg, cq, device, progress, expected(cfg, cq), quantized)


def _quantized_weight(
    entries: dict[str, TensorEntry], module: str, shape: tuple, cq: CheckpointQuantization
) -> QuantizedWeight:
    n, k = shape
    offset_entry = entries[module + ".weight_offset"]
    offset = read_tensor(offset_entry)
    if cq.scheme != "int8z" and bool(offset.ne(0).any()):
        raise CheckpointError(
            f"{offset_entry.file}: tensor {offset_entry.name!r} is not zero: {cq.format} "
            f"weights are symmetric (asymmetric ones load as W8A16); {WHAT_WORKS}"
        )
    scale = read_tensor(entries[module + ".weight_scale"]).bfloat16()  # as vllm-ascend loads it
    q = read_tensor(entries[module + ".weight"])
    if cq.scheme == "int8z":
        z = -offset.double()
        if not (torch.equal(z.round(), z) and bool((z >= -128).all() and (z <= 127).all())):
            raise CheckpointError(
                f"{offset_entry.file}: tensor {offset_entry.name!r} holds offsets that are not "
                "integers in [-127, 128] (rlt-hal keeps -offset as an int8 zero point)"
            )
        assert cq.group_size is not None  # int8z has one
        repeat = k // cq.group_size // scale.shape[1]
        z = z.to(torch.int16).repeat_interleave(repeat, dim=1)
        scale = scale.repeat_interleave(repeat, dim=1)
        return from_integers(q, scale, "int8z", cq.group_size, zero=z)
    if cq.format == STATIC:
        return attrs.evolve(from_integers(q, scale[:, 0], "int8"), static=_static(entries, module))
    if cq.scheme == "int8":
        return from_integers(q, scale[:, 0], "int8")
    assert cq.group_size is not None  # int8g has one
    scale = scale.repeat_interleave(k // cq.group_size // scale.shape[1], dim=1)
    return from_integers(q, scale, "int8g", cq.group_size)


def _static(entries: dict[str, TensorEntry], module: str) -> StaticInput:
    """A W8A8 static module's calibrated input as vllm-ascend's bf16 model holds it:
    ``input_scale`` and ``input_offset`` in bf16 (the offset an integer), ``quant_bias`` int32,
    ``deq_scale`` fp32 (a float16 model's int64 holds the fp32 bits in its low 32)."""
    scale_entry, offset_entry = entries[module + ".input_scale"], entries[module + ".input_offset"]
    scale, offset = read_tensor(scale_entry), read_tensor(offset_entry)
    value = float(offset[0])
    if value != round(value) or not -128 <= value <= 127:
        raise CheckpointError(
            f"{offset_entry.file}: tensor {offset_entry.name!r} is {value}, not an int8 offset"
        )
    if not float(scale[0]) > 0:
        raise CheckpointError(
            f"{scale_entry.file}: tensor {scale_entry.name!r} is {float(scale[0])}, not a "
            "positive scale"
        )
    deq = read_tensor(entries[module + ".deq_scale"])
    if deq.dtype == torch.int64:
        deq = (deq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    bias = read_tensor(entries[module + ".quant_bias"])
    return StaticInput(scale.bfloat16(), offset.bfloat16(), bias, deq.float())


def write(
    src: str | Path, dst: str | Path, weights: dict[str, Any], kind: str, group_size: int
) -> Path:
    """An msModelSlim checkpoint (the AscendV1 layout) of ``kind`` ("W8A16", "W8A8_DYNAMIC"
    or "W8A8") in ``dst``: ``weights`` as ``quantize.quantize_weights`` gave them (int8
    per channel; W8A16 also int8g per group, and int8z (asymmetric: ``weight_offset = -z``);
    W8A8 static: each projection with its calibrated
    input, ``hal.quant.with_static_input``), beside ``src``'s config.json (without a
    ``quantization_config``) and tokenizer."""
    if kind not in TYPES:
        raise ValueError(f"msModelSlim type must be one of {', '.join(TYPES)}, got {kind!r}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    description: dict[str, Any] = {"model_quant_type": kind, "version": "1.0.0", "group_size": 0}
    for name, w in checkpoint_tensors(weights).items():
        if not isinstance(w, QuantizedWeight):
            out[name] = w.contiguous()
            description[name] = "FLOAT"
            continue
        if name == "lm_head.weight" or w.scheme not in ("int8", "int8g", "int8z"):
            raise ValueError(f"msModelSlim {kind} holds int8 projections, got {name} {w.scheme}")
        if w.scheme in ("int8g", "int8z") and kind != "W8A16":
            raise ValueError(f"{kind} takes one scale per channel (int8), not per group")
        module = name[: -len(".weight")]
        n = w.shape[0]
        scale = w.scale.float().view(n, -1)
        if w.scheme in ("int8g", "int8z"):
            description["group_size"] = group_size
        out[name] = w.qweight[:, : w.in_features].contiguous()
        out[module + ".weight_scale"] = scale.contiguous()
        out[module + ".weight_offset"] = (
            -w.zero_points().float() if w.scheme == "int8z" else torch.zeros_like(scale)
        )
        if kind == STATIC:
            if w.static is None:
                raise ValueError(f"W8A8 (static) needs {name}'s calibrated input")
            st = w.static
            out[module + ".input_scale"] = st.scale.float().contiguous()
            out[module + ".input_offset"] = st.offset.float().contiguous()
            out[module + ".quant_bias"] = st.bias.contiguous()
            out[module + ".deq_scale"] = st.deq_scale.float().contiguous()
        for part in [n for n in out if n.startswith(module + ".")]:
            description[part] = kind
    save_file(out, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    (dst / DESCRIPTION).write_text(json.dumps(description, indent=2))
    write_beside(src, dst, None)  # msModelSlim removes quantization_config
    return dst
