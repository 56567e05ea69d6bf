"""Quantized checkpoints made elsewhere: compressed-tensors, llm-compressor's format (vLLM reads
it when ``config.json``'s ``quantization_config.quant_method`` is ``"compressed-tensors"``).

Read straight into ``hal.quant``'s layout, one tensor at a time (no bf16 copy of the model):

- ``pack-quantized``: a Linear module ``M``'s ``M.weight_packed`` (int32 ``[N, K * bits /
  32]``: value ``j`` of a row in bits ``bits * (j % (32 / bits))`` of word ``j // (32 /
  bits)``, stored as ``q + 2^(bits - 1)``), ``M.weight_scale`` (``[N, 1]`` one per channel or
  ``[N, K / group]``), ``M.weight_shape`` (int64 ``[N, K]``);
- ``naive-quantized`` and ``int-quantized`` (llm-compressor's W8A8): ``M.weight`` holds ``q``
  as int8, with the same ``M.weight_scale``.

The value of a weight is ``q * scale``, as compressed-tensors dequantizes it (the product of an
integer and a bf16 scale, rounded once to bf16), which is what ``hal.quant``'s reference kernel
computes: a checkpoint loaded here runs, in HF-exact mode, the weights
``compressed_tensors`` decompresses. ``compressed_write.write`` makes such checkpoints from rlt-hal's own
quantization (``rlt-hal quantize``).

Supported: integer weights of 8 bits (``hal.quant``'s int8: one scale per output channel;
int8g: one per group, llm-compressor's W8A16 preset) and 4 bits (int4, per group or per
channel), symmetric, activations in bf16 (W8A16, W4A16). A group of a multiple of 128 (and
int4 per channel) runs as the kernels' group of 128 with each scale repeated: every value
stays the same. Asymmetric 4-bit weights (llm-compressor's W4A16_ASYM: ``M.weight_zero_point``
``z``, int8 ``[N, K / group]``; pack-quantized packs it along the output channels, int32
``[N / 8, K / group]``) have the value ``(q - z) * scale``: they run as int8 (per channel) or
int8g (per group) holding ``q - z``, in [-15, 15], the same values at twice int4's bytes.
Asymmetric 8-bit weights (``q - z`` spans 511 values) run as ``hal.quant``'s int8z, which
keeps ``q`` and ``z`` (a scale and a zero point per group; per channel: repeated per group). W8A8 (int8 weights per channel, activations int8 per token, dynamic,
symmetric: llm-compressor's W8A8 preset) runs as ``--quantize-activations token``.
Everything else is refused by name before a weight loads. An msModelSlim checkpoint (a
``quant_model_description.json`` beside it) is read by ``runtime_glue.ouro.msmodelslim``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from hal.interfaces import Device
from hal.quant import GROUP_SIZES, QuantizedWeight, from_integers
from runtime_glue.ouro.checkpoint import (
    CheckpointError,
    TensorEntry,
    expected_tensors,
    index_checkpoint,
    read_tensor,
    validate,
)
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.quantize import place

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")  # int-: naive's layout
BITS = (8, 4)
WHAT_WORKS = (
    "rlt-hal loads compressed-tensors W8A16 and W4A16 checkpoints (int8 or int4, per channel "
    "or per group, symmetric or asymmetric) and W8A8 (int8 per channel, activations int8 per token), or "
    "quantizes a bf16 checkpoint at load (--quantization int8|int8g|int4)"
)


@attrs.frozen
class CheckpointQuantization:
    """What a quantized checkpoint says of itself (compressed-tensors: config.json;
    msModelSlim: its description, ``runtime_glue.ouro.msmodelslim``), in ``hal.quant``'s
    terms."""

    format: str  # "pack-quantized", "naive-quantized"; msModelSlim: its type ("W8A16", ...)
    scheme: str  # "int8", "int8g" or "int4"
    group_size: int | None  # the kernels' group (int8g, int4): 32, 64 or 128; int8: None
    stored_group: int | None  # the checkpoint's (None: one scale per output channel)
    lm_head: bool  # lm_head is quantized too
    gate: bool  # the exit gate is quantized (dequantized at load: it is bf16 in rlt-hal)
    method: str = METHOD  # "compressed-tensors" or "msModelSlim"
    activations: str | None = None  # "token": W8A8 dynamic (--quantize-activations token)
    # Asymmetric weights (compressed-tensors' weight_zero_point, msModelSlim's weight_offset):
    # 4-bit ones run as int8 or int8g holding q - zero point, 8-bit ones as int8z.
    zero_points: bool = False

    @property
    def bits(self) -> int:
        """The checkpoint's bits per weight."""
        narrow = self.scheme == "int4" or (self.zero_points and self.scheme != "int8z")
        return 4 if narrow else 8

    def describe(self) -> str:
        """e.g. "compressed-tensors W4A16 (pack-quantized, group 128)", "msModelSlim
        W8A8_DYNAMIC (channel)"."""
        per = "channel" if self.stored_group is None else f"group {self.stored_group}"
        asym = ", asymmetric" if self.zero_points else ""
        if self.method != METHOD:
            return f"{self.method} {self.format} ({per}{asym})"
        acts = 8 if self.activations == "token" else 16
        return f"{METHOD} W{self.bits}A{acts} ({self.format}, {per}{asym})"


def read_quantization(model_dir: str | Path, cfg: OuroConfig) -> CheckpointQuantization | None:
    """The checkpoint's quantization (None for a bf16 checkpoint), from config.json alone; a
    scheme rlt-hal does not run is a one-line error naming it, the file and what works."""
    path = Path(model_dir) / "config.json"
    qc = json.loads(path.read_text()).get("quantization_config")
    if not qc:
        return None

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; {WHAT_WORKS}")

    method = qc.get("quant_method")
    if method != METHOD:
        raise refuse(f"quantization_config.quant_method {method!r} is not supported")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(
            f"quantization_config has {len(groups)} config_groups; rlt-hal loads one scheme "
            "for every projection"
        )
    ((name, group),) = groups.items()
    fmt = group.get("format") or qc.get("format")
    if fmt not in FORMATS:
        raise refuse(f"format {fmt!r} (config group {name!r}) is not supported")
    w = group.get("weights") or {}
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    activations = _activations(group.get("input_activations"), bits, strategy)
    if activations is not None and activations != "token":
        raise refuse(f"config group {name!r}: {activations}")
    if kind != "int" or bits not in BITS:
        raise refuse(f"{kind} weights of {bits} bits (config group {name!r}) are not supported")
    asymmetric = not w.get("symmetric", True)
    if w.get("actorder") not in (None, "static"):
        raise refuse(
            f"activation ordering (actorder {w['actorder']!r}, config group {name!r}: its g_idx "
            "permutes the groups) is not supported"
        )
    if w.get("dynamic"):
        raise refuse(f"dynamic weight quantization (config group {name!r}) is not supported")
    widths = (cfg.hidden_size, cfg.intermediate_size)
    if strategy not in ("channel", "group"):
        raise refuse(
            f"{bits}-bit weights with strategy {strategy!r} (config group {name!r}) are not "
            "supported"
        )
    stored = None if strategy == "channel" else int(w.get("group_size") or 0)
    # Asymmetric 4-bit weights run as int8 (per channel or group) holding q - zero point,
    # in [-15, 15]: exactly the values compressed-tensors decompresses, at twice int4's bytes.
    # Asymmetric 8-bit weights (q - z in [-255, 255]) run as int8z, which keeps z.
    if asymmetric and bits == 8:
        scheme = "int8z"
    elif bits == 8 or asymmetric:
        scheme = "int8" if stored is None else "int8g"
    else:
        scheme = "int4"
    kernels = None if scheme == "int8" else kernel_group(stored, widths)  # the kernels' group
    if scheme != "int8" and kernels is None:
        per = "one scale per channel" if stored is None else f"group size {stored}"
        raise refuse(
            f"{bits}-bit weights with {per} on input widths {widths}: the kernels need groups "
            "of 32, 64 or 128 dividing them"
        )
    targets, ignore = group.get("targets") or [], qc.get("ignore") or []
    flags = {m: _matches(m, targets) and not _matches(m, ignore) for m in linear_modules(cfg)}
    projections = [m for m in flags if m.startswith("model.layers.")]
    plain = [m for m in projections if not flags[m]]
    if plain:
        raise refuse(
            f"the projection {plain[0]!r} is not quantized"
            + (" where others are" if len(plain) < len(projections) else "")
            + ": rlt-hal runs every layer's projections in the checkpoint's scheme"
        )
    return CheckpointQuantization(
        fmt,
        scheme,
        kernels,
        stored,
        flags["lm_head"],
        flags["model.early_exit_gate"],
        activations=activations,
        zero_points=asymmetric,
    )


def _activations(a: dict | None, bits: Any, strategy: Any) -> str | None:
    """None for W8A16 / W4A16; "token" for int8 activations quantized per token, dynamic and
    symmetric, on int8 weights per channel (llm-compressor's W8A8: vLLM's and rlt-hal's
    ``--quantize-activations token`` arithmetic); else why not (refused)."""
    if not a:
        return None
    token = (a.get("type", "int"), a.get("num_bits"), a.get("strategy"), a.get("dynamic"))
    if token != ("int", 8, "token", True) or not a.get("symmetric", True):
        return (
            f"activations quantized as {a.get('type')} {a.get('num_bits')} bits, strategy "
            f"{a.get('strategy')!r}, dynamic {a.get('dynamic')!r}, symmetric "
            f"{a.get('symmetric')!r} are not supported (int8, per token, dynamic, symmetric is)"
        )
    if (bits, strategy) != (8, "channel"):
        return (
            "activations quantized per token take int8 weights per channel (W8A8), not "
            f"{bits}-bit weights with strategy {strategy!r}"
        )
    return "token"


def kernel_group(stored: int | None, widths: tuple[int, ...]) -> int | None:
    """The kernels' group for a checkpoint's (None: one scale per channel): the largest
    group they run that divides every input width and the checkpoint's own, which must be it
    or a multiple of 128 (the scales then repeat: the same values); None if there is none."""
    if stored is not None and (stored < 1 or any(k % stored for k in widths)):
        return None
    for g in sorted(GROUP_SIZES, reverse=True):
        if any(k % g for k in widths):
            continue
        if stored is None or stored == g or (stored % g == 0 and g == max(GROUP_SIZES)):
            return g
    return None


def linear_modules(cfg: OuroConfig) -> list[str]:
    """Every nn.Linear of an Ouro model, by module name (the projections first)."""
    names = [n for n in expected_tensors(cfg) if n.startswith("model.layers.")]
    projections = [n[: -len(".weight")] for n in names if n.endswith("_proj.weight")]
    return projections + ["lm_head", "model.early_exit_gate"]


def _matches(module: str, patterns: list[str]) -> bool:
    """compressed-tensors' (and vLLM's) target matching: "re:<regex>" against the module's
    name, else the name itself or its class ("Linear")."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p in (module, "Linear"):
            return True
    return False


def expected(cfg: OuroConfig, cq: CheckpointQuantization) -> dict[str, tuple[tuple, tuple]]:
    """Name -> (shape, allowed safetensors dtypes) of every tensor the checkpoint holds."""
    out: dict[str, tuple[tuple, tuple]] = {}
    for name, shape in expected_tensors(cfg).items():
        module = name.rsplit(".", 1)[0]
        if not name.endswith(".weight") or not _quantized(module, cq):
            out[name] = (shape, ("BF16",))
            continue
        n, k = shape
        scales = 1 if cq.stored_group is None else k // cq.stored_group
        out[module + ".weight_scale"] = ((n, scales), ("BF16", "F16", "F32"))
        packed = cq.format == "pack-quantized"
        if not packed:  # naive- and int-quantized: M.weight int8
            out[name] = ((n, k), ("I8",))
        else:
            out[module + ".weight_packed"] = ((n, -(-k * cq.bits // 32)), ("I32",))
            out[module + ".weight_shape"] = ((2,), ("I64", "I32"))
        if cq.zero_points:  # packed along the output channels, as compressed-tensors packs it
            zp = ((-(-n * cq.bits // 32), scales), ("I32",)) if packed else ((n, scales), ("I8",))
            out[module + ".weight_zero_point"] = zp
    return out


def _quantized(module: str, cq: CheckpointQuantization) -> bool:
    if module == "lm_head":
        return cq.lm_head
    if module == "model.early_exit_gate":
        return cq.gate
    return module.endswith("_proj")


def unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """``weight_packed`` (int32 ``[N, words]``) to the signed values ``q`` (int8 ``[N, k]``)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [N, words, per]
    return (u.flatten(1)[:, :k] - (1 << (bits - 1))).to(torch.int8)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed values ``q`` (``[N, K]``) as compressed-tensors' ``weight_packed``."""
    per = 32 // bits
    n, k = q.shape
    u = (q.to(torch.int64) + (1 << (bits - 1))).view(n, -1)
    u = torch.nn.functional.pad(u, (0, -k % per)).view(n, -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (u << shifts).sum(dim=-1)  # in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _zero_points(entry: TensorEntry, cq: CheckpointQuantization, n: int) -> torch.Tensor:
    """A module's zero points, int16 ``[N, K / stored group]`` (``[N, 1]`` per channel):
    ``weight_zero_point`` as stored (pack-quantized: packed along the output channels)."""
    z = read_tensor(entry)
    if cq.format == "pack-quantized":
        z = unpack(z.t().contiguous(), cq.bits, n).t()
    lo, hi = -(1 << (cq.bits - 1)), (1 << (cq.bits - 1)) - 1
    if not (lo <= int(z.min()) and int(z.max()) <= hi):
        raise CheckpointError(
            f"{entry.file}: tensor {entry.name!r} holds zero points outside [{lo}, {hi}]"
        )
    return z.to(torch.int16)


def load(
    model_dir: str | Path,
    cfg: OuroConfig,
    cq: CheckpointQuantization,
    device: Device,
    progress: bool = False,
) -> dict[str, Any]:
    """The checkpoint's weights as ``quantize.quantize_weights`` gives them for the same
    scheme: quantized projections (stacked ones once, members as row slices), lm_head if
    quantized, everything else bf16, in one buffer from ``device.alloc_weights``. (An
    msModelSlim checkpoint: ``runtime_glue.ouro.msmodelslim.load``.)"""

    def quantized(entries: dict[str, TensorEntry], name: str, shape: tuple) -> Any:
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and _quantized(module, cq)):
            return None
        w = _quantized_weight(entries, module, shape, cq)
        return w.dequantize() if module == "model.early_exit_gate" else w

    return load_stored(model_dir, cfg, cq, device, progress, expected(cfg, cq), quantized)


def load_stored(
    model_dir: str | Path,
    cfg: OuroConfig,
    cq: CheckpointQuantization,
    device: Device,
    progress: bool,
    tensors: dict[str, tuple[tuple, tuple]],
    quantized: Callable[[dict[str, TensorEntry], str, tuple], Any],
) -> dict[str, Any]:
    """A checkpoint quantized elsewhere, placed one tensor at a time (``quantize.place``):
    its tensors checked against ``tensors`` first; ``quantized(entries, name, shape)`` gives a
    checkpoint tensor as the model takes it, or None where it is read as stored."""
    entries = index_checkpoint(model_dir)
    validate(entries, cfg, model_dir, tensors)
    shapes = expected_tensors(cfg)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(shapes), desc="loading weights", unit="tensor")

    def made(name: str) -> Any:
        w = quantized(entries, name, shapes[name])
        if w is None:
            w = read_tensor(entries[name])
        if bar is not None:
            bar.update()
        return w

    weights = place(cfg, cq.scheme, cq.group_size, cq.lm_head, made, device)
    if bar is not None:
        bar.close()
    return weights


def _quantized_weight(
    entries: dict[str, TensorEntry], module: str, shape: tuple, cq: CheckpointQuantization
) -> QuantizedWeight:
    n, k = shape
    scale_entry = entries[module + ".weight_scale"]
    scale = read_tensor(scale_entry)
    if not torch.equal(scale.bfloat16().to(scale.dtype), scale):
        raise CheckpointError(
            f"{scale_entry.file}: tensor {scale_entry.name!r} holds scales that bf16 cannot "
            "hold exactly; rlt-hal's kernels take bf16 scales"
        )
    if cq.format != "pack-quantized":  # naive- and int-quantized: M.weight int8
        q = read_tensor(entries[module + ".weight"])
        lo, hi = -(1 << (cq.bits - 1)), (1 << (cq.bits - 1)) - 1
        if cq.bits == 4 and not (lo <= int(q.min()) and int(q.max()) <= hi):
            e = entries[module + ".weight"]
            raise CheckpointError(f"{e.file}: tensor {e.name!r} holds values outside [{lo}, {hi}]")
    else:
        shape_entry = entries[module + ".weight_shape"]
        stored = [int(v) for v in read_tensor(shape_entry)]
        if stored != [n, k]:
            raise CheckpointError(
                f"{shape_entry.file}: tensor {shape_entry.name!r} says {stored}, config.json "
                f"implies {[n, k]}"
            )
        q = unpack(read_tensor(entries[module + ".weight_packed"]), cq.bits, k)
    z = None
    if cq.zero_points:
        z = _zero_points(entries[module + ".weight_zero_point"], cq, n)
        if cq.scheme != "int8z":  # 4 bits: q - z, each zero point over its group's inputs
            q = q.to(torch.int16) - z.repeat_interleave(k // z.shape[1], dim=1)
            z = None
    scale = scale.bfloat16()
    if cq.scheme == "int8":
        return from_integers(q, scale[:, 0], "int8")
    # Per channel or per a multiple of the kernels' group: each scale (and zero) repeated.
    assert cq.group_size is not None  # int8g, int4 and int8z have one
    repeat = k // cq.group_size // scale.shape[1]
    scale = scale.repeat_interleave(repeat, dim=1)
    if z is not None:
        z = z.repeat_interleave(repeat, dim=1)
    return from_integers(q, scale, cq.scheme, cq.group_size, zero=z)
