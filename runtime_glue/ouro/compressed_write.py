"""Writing compressed-tensors checkpoints (``rlt-hal quantize --format compressed-tensors``):
the quantized tensors in llm-compressor's layout, config.json's ``quantization_config``, and the
tokenizer beside them (``write_beside``, which msModelSlim's writer shares). Reading them:
``runtime_glue.ouro.compressed``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hal.quant import QuantizedWeight
from runtime_glue.ouro.compressed import METHOD, pack
from runtime_glue.ouro.quantize import checkpoint_tensors


def quantization_config(
    scheme: str, group_size: int, lm_head: bool = False, activations: bool = False
) -> dict[str, Any]:
    """config.json's ``quantization_config`` for weights quantized by ``hal.quant`` (int8: one
    scale per channel; int8g, int4: per group; int8z: per group, asymmetric), as llm-compressor
    writes it for W8A16 /
    W4A16; ``activations``: int8 per channel with the activations quantized per token, as it
    writes W8A8 ("int-quantized")."""
    weights: dict[str, Any] = {
        "num_bits": 4 if scheme == "int4" else 8,
        "type": "int",
        "symmetric": scheme != "int8z",
        "strategy": "channel" if scheme == "int8" else "group",
        "group_size": None if scheme == "int8" else group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "block_structure": None,
    }
    fmt = "pack-quantized"
    inputs = None
    if activations:
        assert scheme == "int8", "W8A8 takes int8 weights per channel"
        fmt = "int-quantized"
        inputs = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "group_size": None,
            "dynamic": True,
            "actorder": None,
            "observer": None,
            "observer_kwargs": {},
            "block_structure": None,
        }
    return {
        "quant_method": METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["model.early_exit_gate"] + ([] if lm_head else ["lm_head"]),
        "kv_cache_scheme": None,
    }


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def write(
    src: str | Path,
    dst: str | Path,
    weights: dict[str, Any],
    scheme: str,
    group_size: int,
    activations: bool = False,
) -> Path:
    """A compressed-tensors checkpoint in ``dst`` of ``weights`` (as
    ``quantize.quantize_weights`` gave them) beside ``src``'s config.json and tokenizer:
    pack-quantized; with ``activations`` (int8 weights run with per-token activations, W8A8)
    int-quantized (``M.weight`` int8)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    head = False
    for name, w in checkpoint_tensors(weights).items():
        if not isinstance(w, QuantizedWeight):
            out[name] = w.contiguous()
            continue
        module = name[: -len(".weight")]
        head = head or module == "lm_head"
        bits = 4 if w.scheme == "int4" else 8
        n, k = w.shape
        out[module + ".weight_scale"] = w.scale.view(n, -1).contiguous()
        if activations:
            out[name] = w.integers().contiguous()
            continue
        q = w.qweight[:, :k] if w.scheme == "int8z" else w.integers()  # int8z: q, z apart
        out[module + ".weight_packed"] = pack(q, bits)
        out[module + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if w.scheme == "int8z":  # packed along the output channels, as compressed-tensors does
            out[module + ".weight_zero_point"] = pack(w.zero_points().t(), bits).t().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    write_beside(src, dst, quantization_config(scheme, group_size, head, activations))
    return dst


def write_beside(src: str | Path, dst: Path, config_quantization: dict | None) -> None:
    """``src``'s config.json in ``dst`` with ``quantization_config`` set (None: removed), and
    its tokenizer files copied."""
    config = json.loads((Path(src) / "config.json").read_text())
    config.pop("quantization_config", None)
    if config_quantization is not None:
        config["quantization_config"] = config_quantization
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (Path(src) / f).is_file():
            shutil.copy2(Path(src) / f, dst / f)
