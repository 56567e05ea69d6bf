"""The model's weights for an engine: a checkpoint quantized elsewhere taken as its own
``--quantization``, the memory budget checked from config.json before a weight is read, then
the checkpoint loaded (and quantized at load where asked) onto the driver's device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from hal.interfaces import Device
from runtime_glue.engine.args import EngineArgs
from runtime_glue.ouro import compressed, msmodelslim
from runtime_glue.ouro.checkpoint import load_weights
from runtime_glue.ouro.compressed import CheckpointQuantization
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.quantize import expected_weight_bytes, quantize_weights


def read_stored_quantization(model_dir: Path, cfg: OuroConfig) -> CheckpointQuantization | None:
    """How the checkpoint is quantized (None: bf16): msModelSlim's description, else
    compressed-tensors' config.json; a scheme rlt-hal does not run is a one-line error."""
    if msmodelslim.is_msmodelslim(model_dir):
        return msmodelslim.read_quantization(model_dir, cfg)
    return compressed.read_quantization(model_dir, cfg)


def with_stored_quantization(args: EngineArgs, stored: CheckpointQuantization) -> EngineArgs:
    """``args`` for a checkpoint quantized elsewhere: its scheme as ``--quantization`` (and a
    W8A8 dynamic checkpoint's activations as ``--quantize-activations token``, unless another
    choice is given; a W8A8 static one's as ``static``)."""
    if args.quantization not in (None, stored.scheme):
        raise ValueError(
            f"--quantization {args.quantization}: the checkpoint is already quantized "
            f"({stored.describe()}); leave --quantization out to run it as stored"
        )
    if args.quantize_lm_head and not stored.lm_head:
        raise ValueError(
            f"--quantize-lm-head: the checkpoint ({stored.describe()}) keeps lm_head in bf16"
        )
    return attrs.evolve(
        args,
        quantization=stored.scheme,
        quantization_group_size=stored.group_size or args.quantization_group_size,
        quantize_lm_head=stored.lm_head,
        quantize_activations=args.quantize_activations or stored.activations,
    )


def check_static_activations(args: EngineArgs, stored: CheckpointQuantization | None) -> None:
    """``--quantize-activations static`` where the checkpoint stores no calibrated input scales
    (only a W8A8 static checkpoint does), refused before a weight loads."""
    if args.quantize_activations == "static" and (stored is None or stored.activations != "static"):
        held = "is not quantized" if stored is None else f"is {stored.describe()}"
        raise ValueError(
            "--quantize-activations static quantizes each projection's input with the "
            "calibrated scale and offset a W8A8 static checkpoint stores (msModelSlim W8A8), "
            f"and this checkpoint {held}: use --quantize-activations token or block"
        )


def check_weights_fit(args: EngineArgs, cfg: OuroConfig) -> None:
    """A ``--memory-budget`` the weights would not fit in, refused from config.json alone."""
    if args.memory_budget is None:
        return
    need = expected_weight_bytes(
        cfg, args.quantization, args.quantization_group_size, args.quantize_lm_head
    )
    if args.memory_budget <= need:
        raise ValueError(
            f"memory_budget {args.memory_budget} bytes does not hold the weights "
            f"({need} bytes in {args.quantization or 'bf16'}, from config.json; nothing "
            "was loaded)"
        )


def load_model_weights(
    args: EngineArgs,
    cfg: OuroConfig,
    model_dir: Path,
    stored: CheckpointQuantization | None,
    device: Device,
    progress: bool,
) -> dict[str, Any]:
    """The checkpoint's weights on ``device``: as stored (``stored``: compressed-tensors or
    msModelSlim), or bf16 quantized at load in ``args.quantization`` where asked."""
    if stored is not None:
        fmt = msmodelslim if stored.method == msmodelslim.METHOD else compressed
        return fmt.load(model_dir, cfg, stored, device, progress)
    weights = load_weights(model_dir, cfg, device, progress=progress)
    if args.quantization is None:
        return weights
    return quantize_weights(
        weights,
        cfg,
        args.quantization,
        args.quantization_group_size,
        args.quantize_lm_head,
        device,
    )
