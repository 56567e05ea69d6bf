"""Ouro checkpoints in the Hugging Face layout: strict validation, then loading.

Every expected tensor is checked (present, no extras, shape, dtype, bytes inside the file)
from the safetensors headers alone, before a single weight is read or any compute runs.
Errors name the file and the tensor at fault.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from pathlib import Path

import attrs
import torch

from hal.interfaces import Device
from runtime_glue.ouro.config import OuroConfig

INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that does not match its config.json (message names file and tensor)."""


@attrs.frozen
class TensorEntry:
    name: str
    file: Path
    dtype: str  # safetensors spelling: BF16, F32, ...
    shape: tuple[int, ...]
    offset: int  # where the tensor's bytes start in the file
    nbytes: int


def expected_tensors(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an Ouro checkpoint with this config holds."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_out, h),
                p + "self_attn.k_proj.weight": (kv_out, h),
                p + "self_attn.v_proj.weight": (kv_out, h),
                p + "self_attn.o_proj.weight": (h, q_out),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        for norm in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            shapes[p + norm + ".weight"] = (h,)
    shapes.update(
        {
            "model.norm.weight": (h,),
            "model.early_exit_gate.weight": (1, h),
            "model.early_exit_gate.bias": (1,),
            "lm_head.weight": (cfg.vocab_size, h),
        }
    )
    return shapes


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors header and check that every tensor's bytes lie inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors header "
                f"(header says {header_len} bytes, file has {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    data_size = size - 8 - header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        numel = 1
        for s in shape:
            numel *= s
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} is truncated (needs bytes up to "
                f"{end}, the file's data section has {data_size})"
            )
        if end - start != numel * _DTYPE_SIZES.get(info["dtype"], 0):
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - start} bytes, which does "
                f"not match dtype {info['dtype']} and shape {list(shape)}"
            )
        entries[name] = TensorEntry(
            name, path, info["dtype"], shape, 8 + header_len + start, end - start
        )
    return entries


def index_checkpoint(model_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a single-file or sharded checkpoint, from the headers alone."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        weight_map = None
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (and no {INDEX_FILE})")
    entries: dict[str, TensorEntry] = {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{index_path}: lists shard {path.name!r}, which is missing")
        for name, entry in read_header(path).items():
            if name in entries:
                raise CheckpointError(
                    f"{path}: tensor {name!r} also appears in {entries[name].file.name}"
                )
            entries[name] = entry
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in entries or entries[name].file.name != Path(shard).name:
                raise CheckpointError(
                    f"{index_path}: says tensor {name!r} is in {shard!r}, "
                    "but that shard does not hold it"
                )
    return entries


def validate(
    entries: dict[str, TensorEntry],
    cfg: OuroConfig,
    model_dir: str | Path,
    tensors: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] | None = None,
) -> None:
    """Every tensor present, none extra, each of its shape and dtype: ``tensors`` maps a name
    to its shape and the safetensors dtypes it may have (default: ``expected_tensors`` in
    config.json's dtype)."""
    if tensors is None:
        want = {v: k for k, v in _DTYPE_NAMES.items()}[cfg.torch_dtype]
        tensors = {name: (shape, (want,)) for name, shape in expected_tensors(cfg).items()}
    expected = {name: shape for name, (shape, _) in tensors.items()}
    missing = [n for n in expected if n not in entries]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"{model_dir}: missing tensor(s) {shown}")
    unexpected = sorted(set(entries) - set(expected))
    if unexpected:
        e = entries[unexpected[0]]
        raise CheckpointError(
            f"{e.file}: unexpected tensor {e.name!r} (and {len(unexpected) - 1}"
            " more); it is not part of an Ouro model with this config.json"
        )
    for name, shape in expected.items():
        e = entries[name]
        if e.shape != shape:
            raise CheckpointError(
                f"{e.file}: tensor {name!r} has shape {list(e.shape)}, "
                f"config.json implies {list(shape)}"
            )
        dtypes = tensors[name][1]
        if e.dtype not in dtypes:
            raise CheckpointError(
                f"{e.file}: tensor {name!r} has dtype {e.dtype}, expected "
                + (
                    f"{dtypes[0]} ({cfg.torch_dtype})"
                    if dtypes == ("BF16",)
                    else " or ".join(dtypes)
                )
            )


# Checkpoint tensors stored back to back, so that a stacked weight is a view of its members
# and a column-invariant linear kernel (`Kernel.column_invariant`) makes one call for them.
STACKED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_ALIGN = 64  # elements between groups: keeps every group's start cache-line aligned


def _groups(entries: dict[str, TensorEntry], cfg: OuroConfig) -> dict[str, list[str]]:
    """Name of each stored group -> its members in order; a lone tensor is its own group."""
    groups: dict[str, list[str]] = {}
    stacked: set[str] = set()
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, members in STACKED.items():
            groups[p + name] = [p + m for m in members]
            stacked.update(groups[p + name])
    groups.update({name: [name] for name in entries if name not in stacked})
    return groups


_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """One tensor, read into a new host tensor."""
    out = torch.empty(entry.shape, dtype=_TORCH_DTYPES[entry.dtype])
    with entry.file.open("rb", buffering=0) as f:
        _read_into(f, entry, out)
    return out


def _read_into(f, entry: TensorEntry, dest: torch.Tensor) -> None:
    """Read one tensor's bytes straight into ``dest``, through a host tensor when ``dest`` is
    on a device. Plain reads, not a file mapping: peak memory stays at the weights."""
    host = dest if dest.device.type == "cpu" else torch.empty(dest.shape, dtype=dest.dtype)
    buf = memoryview((ctypes.c_char * entry.nbytes).from_address(host.data_ptr())).cast("B")
    f.seek(entry.offset)
    done = 0
    while done < entry.nbytes:
        got = f.readinto(buf[done:])
        if not got:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} is truncated")
        done += got
    if host is not dest:
        dest.copy_(host)


def load_weights(
    model_dir: str | Path, cfg: OuroConfig, device: Device, progress: bool = False
) -> dict[str, torch.Tensor]:
    """Validate the whole checkpoint, then read every tensor into one buffer from
    ``device.alloc_weights``. Returns each checkpoint tensor as a view of that buffer, plus
    each layer's stacked views named by ``STACKED`` (``model.layers.0.mlp.gate_up_proj.weight``).
    """
    entries = index_checkpoint(model_dir)
    validate(entries, cfg, model_dir)
    groups = _groups(entries, cfg)
    offsets: dict[str, int] = {}
    total = 0
    for members in groups.values():
        total = -(-total // _ALIGN) * _ALIGN
        for name in members:
            offsets[name] = total
            total += math.prod(entries[name].shape)
    buffer = device.alloc_weights(total, getattr(torch, cfg.torch_dtype))

    def view(name: str, rows: int | None = None) -> torch.Tensor:
        shape = entries[name].shape if rows is None else (rows, *entries[name].shape[1:])
        return buffer[offsets[name] : offsets[name] + math.prod(shape)].view(shape)

    weights = {name: view(name) for name in entries}
    for name, members in groups.items():
        if len(members) > 1:
            weights[name] = view(members[0], sum(entries[m].shape[0] for m in members))
    by_file: dict[Path, list[TensorEntry]] = {}
    for e in entries.values():
        by_file.setdefault(e.file, []).append(e)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(entries), desc="loading weights", unit="tensor")
    for path, file_entries in sorted(by_file.items()):
        with path.open("rb", buffering=0) as f:
            for e in sorted(file_entries, key=lambda e: e.offset):  # one sequential pass
                _read_into(f, e, weights[e.name])
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return weights
