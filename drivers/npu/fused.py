"""The npu driver's fused kernels and its ``ascend_fia`` attention backend (the fast plan).

Each is a HAL value offered next to the exact ones and claims nothing: none is HF-exact or
row-invariant. The execution plan admits one only in ``--mode fast``, after comparing it on
this device at this model's shapes with the exact path (``runtime_glue.ouro.admission``).
Every kernel calls torch_npu's op (or its emulation, ``drivers.npu.fused_ops``) through the
device's op table, looked up at call time: the table exists once the device is initialised.

Call forms follow torch_npu's documentation and vllm-ascend's use of the same ops:
``npu_rotary_mul`` on the BSND view of one step's q|k, ``npu_scatter_pa_kv_cache`` on the
paged cache ``[num_blocks, block_size, kv_heads, d]`` (``cache_mode='Norm'``: ND caches),
and ``npu_fused_infer_attention_score`` in TND layout over that cache viewed as
``[num_blocks, block_size, kv_heads * d]`` with the step's block table, the cumulative query
ends and each request's KV length, ``sparse_mode=3`` (right-down causal) with the
optimised 2048 x 2048 mask.
"""

from __future__ import annotations

from typing import Any

import torch

from hal.eager import TensorKVStore
from hal.graphs import StaticDecodeMetadata
from hal.interfaces import AttentionBackend
from hal.kernels import Kernel, KernelUnavailable

VERSION = "npu-fused-1"
FUSED_OPS = (
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_scatter_pa_kv_cache",
    "npu_fused_infer_attention_score",
)


class _Ops:
    """The device's op table, read when a kernel runs (after ``initialize()``)."""

    def __init__(self, device) -> None:
        self.device = device

    def __call__(self, name: str) -> Any:
        if self.device.ops is None:
            self.device.initialize()
        op = getattr(self.device.ops, name, None)
        if op is None:
            raise KernelUnavailable(f"this torch_npu has no {name}; upgrade torch-npu")
        return op

    def check(self, name: str):
        return lambda: self(name) and None


def _joined(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """``cat((a, b), dim)``: a view when ``b`` starts where ``a`` ends along ``dim``, strides
    alike (the halves of one stacked projection), else a copy."""
    dim = dim % a.dim()
    same = a.stride() == b.stride() and all(
        a.shape[i] == b.shape[i] for i in range(a.dim()) if i != dim
    )
    step = a.shape[dim] * a.stride(dim) * a.element_size()
    if same and b.data_ptr() == a.data_ptr() + step:
        shape = list(a.shape)
        shape[dim] += b.shape[dim]
        return a.as_strided(shape, a.stride())
    return torch.cat((a, b), dim)


def kernels(device) -> tuple[Kernel, ...]:
    ops = _Ops(device)

    def rms_norm(x, weight, eps):
        return ops("npu_rms_norm")(x, weight, eps)[0]

    def add_rms_norm(x, residual, weight, eps):
        y, _, total = ops("npu_add_rms_norm")(residual, x, weight, eps)
        return y, total

    def swiglu(gate, up):
        return ops("npu_swiglu")(_joined(gate, up, -1), -1)

    def rotary(q, k, cos, sin):
        n, hq, d = q.shape
        qk = _joined(q, k, 1).view(1, n, hq + k.shape[1], d).contiguous()  # BSND
        out = ops("npu_rotary_mul")(qk, cos.view(1, n, 1, d), sin.view(1, n, 1, d))
        return out[0, :, :hq], out[0, :, hq:]

    def fused(op: str, name: str, fn, description: str) -> Kernel:
        check = ops.check(name)
        return Kernel(op, name, fn, fast_only=True, check=check, description=description,
                      version=VERSION)  # fmt: skip

    return (
        fused("rms_norm", "npu_rms_norm", rms_norm, "fp32 inside, one rounding"),
        fused("add_rms_norm", "npu_add_rms_norm", add_rms_norm, "residual add and norm, one op"),
        fused("silu_mul", "npu_swiglu", swiglu, "on the stacked gate|up"),
        fused("rotary", "npu_rotary_mul", rotary, "q|k in one call (BSND)"),
    )


class AscendFiaBackend(AttentionBackend):
    """``npu_fused_infer_attention_score`` over the paged cache with the block table: one
    call per plane for every request of a step; K/V written by one
    ``npu_scatter_pa_kv_cache`` call. Not HF-exact (fp32 softmax over fused tiles).

    Two forms: a step with prompt rows passes each request's exact lengths with
    ``sparse_mode=3`` (right-down causal); a decode-only step (``StaticDecodeMetadata``: the
    fast plan runs every decode-only step so, eager or captured in a step graph) reads each
    row's context bucket with a padding mask (``sparse_mode=0``, :meth:`_decode_view`)."""

    name = "ascend_fia"
    hf_exact = False
    supports_deterministic = False
    step_graphs = True  # its decode form reads only static buffers (_decode_view)

    def __init__(self, device) -> None:
        self.ops = _Ops(device)
        self.device = device
        self._mask: torch.Tensor | None = None
        self._view: tuple | None = None  # (metadata, table, mask) of the step running

    def _paged(self, kv, plane: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(kv, TensorKVStore):
            raise TypeError(f"ascend_fia needs the npu driver's paged KV store, got {kv!r}")
        lay = kv.layout
        shape = (-1, lay.block_size, lay.num_kv_heads, lay.head_dim)  # from plane on
        return kv.rows(kv.key_cache, plane).view(shape), kv.rows(kv.value_cache, plane).view(shape)

    def write_kv(self, kv, plane, key, value, meta) -> None:
        k_cache, v_cache = self._paged(kv, plane)
        self.ops("npu_scatter_pa_kv_cache")(
            key.contiguous(), value.contiguous(), k_cache, v_cache, meta.slot_mapping,
            cache_mode="Norm",
        )  # fmt: skip

    def mask(self) -> torch.Tensor:
        if self._mask is None:
            from drivers.npu.fused_ops import causal_mask

            self._mask = causal_mask().to(self.device.torch_device)
        return self._mask

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        if deterministic:
            raise ValueError("ascend_fia does not support deterministic mode")
        _, heads, n, d = query.shape
        k_cache, v_cache = self._paged(kv, plane)
        nb, bs, kv_heads, _ = k_cache.shape
        mask: torch.Tensor | None
        if isinstance(meta, StaticDecodeMetadata):  # decode rows: the bucket, under a mask
            table, mask = self._decode_view(meta)
            width = table.shape[1] * bs
            q_ends, kv_lens, sparse = list(range(1, n + 1)), [width] * n, 0
        else:  # each request's exact lengths, right-down causal
            q_ends = list(meta.host_query_start_loc[1:])
            kv_lens = [meta.request(r)[1] + meta.request(r)[2] for r in range(meta.num_requests)]
            prefill = any(meta.request(r)[1] > 1 for r in range(meta.num_requests))
            table, mask, sparse = meta.block_tables, self.mask() if prefill else None, 3
        out, _ = self.ops("npu_fused_infer_attention_score")(
            query[0].transpose(0, 1).contiguous(),  # [T, N, D]; a view for one decode row
            k_cache.view(nb, bs, kv_heads * d),
            v_cache.view(nb, bs, kv_heads * d),
            atten_mask=mask,
            actual_seq_lengths=q_ends,
            actual_seq_lengths_kv=kv_lens,
            block_table=table,
            num_heads=heads,
            scale=scaling,
            input_layout="TND",
            num_key_value_heads=kv_heads,
            sparse_mode=sparse,
            block_size=bs,
        )
        return out.view(n, heads * d)

    def _decode_view(self, meta: StaticDecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode form's block table ``[B, W]`` (int32) and mask ``[B, 1, 1, W * bs]``
        (True: past the row's ``seq_len``), once per step (every plane reads the same). The
        lengths are then the bucket's, constant per captured shape: the step needs no
        per-step host argument (no ``NPUGraph.update``)."""
        cached = self._view
        if cached is None or cached[0] is not meta:
            cached = self._view = (meta, meta.block_tables.to(torch.int32), meta.masked)
        return cached[1], cached[2]
