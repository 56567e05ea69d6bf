"""EMULATED fused torch_npu kernels: CPU test doubles for the Ascend ops the fast plan calls.

Each op is a real custom op (``torch.ops.rlt_npu_emulated.*``, declared with
``torch.library``) with a fake (meta) kernel giving the shapes torch_npu's own meta functions
give, so a ``TorchDispatchMode`` sees one op per emulated kernel: the one device op it stands
for (``hal.devops`` counts them that way). The emulated ``torch_npu`` exposes them under
torch_npu's names (``drivers.npu.emulation``). Signatures, layouts and argument rules are
written from torch_npu 2.13.0's documentation and meta registrations
(``torch_npu/_op_plugin_docs.py``, ``torch_npu/op_plugin/meta/_meta_registrations.py``);
the arithmetic (fp32 inside, one rounding to the input dtype at the end) is this emulation's
model of the fused kernels, not a measurement of them: nothing here is a hardware result.

Only the forms the npu driver uses are emulated; an argument outside them raises
``NotImplementedError`` naming it, and a documented rule broken raises ``RuntimeError``
("... (torch_npu's documented rule)"), as the real op refuses it.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MASK_SIZE = 2048  # sparse_mode 2..4 take an optimised 2048 x 2048 causal mask
_CHECKED_MASKS: dict[int, weakref.ref] = {}  # id -> the mask checked (checked once each)


def refuse(op: str, rule: str):
    raise RuntimeError(f"{op}: {rule} (torch_npu's documented rule)")


# -- npu_rms_norm / npu_add_rms_norm --------------------------------------------------------


def _rstd_shape(x: Tensor, gamma: Tensor) -> list[int]:
    keep = x.dim() - gamma.dim()
    return [x.shape[i] if i < keep else 1 for i in range(x.dim())]


def _check_norm(op: str, x: Tensor, gamma: Tensor) -> None:
    if x.dtype not in FLOATS:
        refuse(op, f"input must be float16, bfloat16 or float32, got {x.dtype}")
    if gamma.dtype != x.dtype:
        refuse(op, f"gamma must have the input's dtype {x.dtype}, got {gamma.dtype}")
    if not 1 <= gamma.dim() <= x.dim() or tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(
        gamma.shape
    ):
        refuse(op, f"gamma {list(gamma.shape)} must be the trailing dims of input {list(x.shape)}")


def _rms(x: Tensor, gamma: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@torch.library.custom_op("rlt_npu_emulated::npu_rms_norm", mutates_args=())
def _rms_norm(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    _check_norm("npu_rms_norm", x, gamma)
    return _rms(x, gamma, epsilon)


@_rms_norm.register_fake
def _(x, gamma, epsilon):
    rstd = x.new_empty(_rstd_shape(x, gamma), dtype=torch.float32)
    return torch.empty_like(x), rstd


@torch.library.custom_op("rlt_npu_emulated::npu_add_rms_norm", mutates_args=())
def _add_rms_norm(
    x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float
) -> tuple[Tensor, Tensor, Tensor]:
    _check_norm("npu_add_rms_norm", x1, gamma)
    if x2.shape != x1.shape or x2.dtype != x1.dtype:
        refuse("npu_add_rms_norm", "x1 and x2 must have one shape and dtype")
    x = x1 + x2  # the sum, rounded to the dtype: the op's third output
    y, rstd = _rms(x, gamma, epsilon)
    return y, rstd, x


@_add_rms_norm.register_fake
def _(x1, x2, gamma, epsilon):
    rstd = x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)
    return torch.empty_like(x1), rstd, torch.empty_like(x1)


def npu_rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``."""
    return _rms_norm(x, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x1 + x2)``."""
    return _add_rms_norm(x1, x2, gamma, epsilon)


# -- npu_swiglu ------------------------------------------------------------------------------


@torch.library.custom_op("rlt_npu_emulated::npu_swiglu", mutates_args=())
def _swiglu(x: Tensor, dim: int) -> Tensor:
    if x.dtype not in FLOATS:
        refuse("npu_swiglu", f"input must be float32, float16 or bfloat16, got {x.dtype}")
    if not 1 <= x.dim() <= 8 or x.shape[dim] % 2:
        refuse("npu_swiglu", f"input must be 1-8-D with an even dim {dim}, got {list(x.shape)}")
    a, b = x.float().chunk(2, dim)  # swish(A) * B, A the first half
    return (a * torch.sigmoid(a) * b).to(x.dtype)


@_swiglu.register_fake
def _(x, dim):
    shape = list(x.shape)
    shape[dim] = math.floor(shape[dim] / 2)
    return x.new_empty(shape)


def npu_swiglu(x: Tensor, dim: int = -1) -> Tensor:
    """``torch_npu.npu_swiglu(self, dim=-1)``: ``swish(A) * B`` for ``A, B = x.chunk(2, dim)``."""
    return _swiglu(x, dim)


# -- npu_rotary_mul --------------------------------------------------------------------------


@torch.library.custom_op("rlt_npu_emulated::npu_rotary_mul", mutates_args=())
def _rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str) -> Tensor:
    op = "npu_rotary_mul"
    if rotary_mode != "half":
        raise NotImplementedError(f"{op}: only rotary_mode='half' is emulated")
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        refuse(op, "input, r1 and r2 must be 4-D")
    if x.dtype not in FLOATS or r1.dtype != x.dtype or r2.dtype != x.dtype:
        refuse(op, "input, r1 and r2 must share one float16, bfloat16 or float32 dtype")
    d = x.shape[-1]
    if d % 2 or d >= 896:
        refuse(op, f"D must be even and < 896, got {d}")
    if r1.shape != r2.shape or r1.shape[-1] != d:
        refuse(op, f"r1 and r2 must share a shape ending in D={d}")
    try:
        torch.broadcast_shapes(r1.shape, x.shape)
    except RuntimeError:
        refuse(op, f"r1 {list(r1.shape)} must broadcast to input {list(x.shape)}")
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (r1.float() * xf + r2.float() * rotated).to(x.dtype)


@_rotary_mul.register_fake
def _(x, r1, r2, rotary_mode):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def npu_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half", rotate=None):
    """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half')``:
    ``r1 * x + r2 * cat(-x2, x1)`` with ``x1, x2 = x.chunk(2, -1)``; a new tensor."""
    if rotate is not None:
        raise NotImplementedError("npu_rotary_mul: the rotate matrix is not emulated")
    return _rotary_mul(x, r1, r2, rotary_mode)


# -- npu_scatter_pa_kv_cache -----------------------------------------------------------------


@torch.library.custom_op(
    "rlt_npu_emulated::npu_scatter_pa_kv_cache", mutates_args=("key_cache", "value_cache")
)
def _scatter_pa_kv_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    with torch._C.DisableTorchFunction():  # the checks read indices; the real op never does
        _check_scatter_pa(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


@_scatter_pa_kv_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping):
    return None


def _check_scatter_pa(key, value, key_cache, value_cache, slot_mapping) -> None:
    op = "npu_scatter_pa_kv_cache"
    tensors = (key, value, key_cache, value_cache, slot_mapping)
    if not all(t.is_contiguous() for t in tensors):
        refuse(op, "inputs must be contiguous")
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise NotImplementedError(
            f"{op}: only scenario two is emulated (key [tokens, heads, d], caches [num_blocks, "
            f"block_size, heads, d]), got key {list(key.shape)}, cache {list(key_cache.shape)}"
        )
    if len({t.dtype for t in tensors[:4]}) != 1:
        refuse(op, "key, value, key_cache and value_cache must share one dtype")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        refuse(op, f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.shape[:2] != value.shape[:2] or slot_mapping.shape != key.shape[:1]:
        refuse(op, "key, value and slot_mapping must agree on the token count")
    if key.shape[1:] != key_cache.shape[2:] or value.shape[1:] != value_cache.shape[2:]:
        refuse(op, f"key rows {list(key.shape[1:])} must match cache rows {key_cache.shape[2:]}")
    slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() and not (
        int(slot_mapping.min()) >= 0 and int(slot_mapping.max()) < slots
    ):
        refuse(op, f"slot_mapping values must be in [0, {slots - 1}]")
    if slot_mapping.unique().numel() != slot_mapping.numel():
        refuse(op, "slot_mapping values must not repeat")


def npu_scatter_pa_kv_cache(
    key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
    compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ",
):  # fmt: skip
    """``torch_npu.npu_scatter_pa_kv_cache(...)``: writes ``key``/``value`` rows in place at
    ``slot_mapping`` (slot ``s``: block ``s // block_size``, row ``s % block_size``)."""
    if cache_mode not in (None, "Norm"):
        raise NotImplementedError(
            f"npu_scatter_pa_kv_cache: cache_mode {cache_mode!r} needs caches in the NZ format "
            "(npu_format_cast 29); the emulation keeps ND caches: pass cache_mode='Norm'"
        )
    if any(a is not None for a in (compress_lens, compress_seq_offsets, seq_lens)):
        raise NotImplementedError("npu_scatter_pa_kv_cache: compression is not emulated")
    _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping)


# -- npu_fused_infer_attention_score (TND, page attention) -----------------------------------


@torch.library.custom_op("rlt_npu_emulated::npu_fused_infer_attention_score", mutates_args=())
def _fia(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    atten_mask: Tensor | None,
    actual_seq_lengths: list[int],
    actual_seq_lengths_kv: list[int],
    block_table: Tensor,
    num_heads: int,
    scale: float,
    num_key_value_heads: int,
    sparse_mode: int,
    block_size: int,
) -> tuple[Tensor, Tensor]:
    kv_heads = num_key_value_heads or num_heads
    with torch._C.DisableTorchFunction():
        _check_fia(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                   block_table, num_heads, kv_heads, sparse_mode, block_size)  # fmt: skip
    out = torch.empty_like(query)
    d, rep = query.shape[-1], num_heads // kv_heads
    starts = [0, *actual_seq_lengths]
    for b, kv_len in enumerate(actual_seq_lengths_kv):
        q = query[starts[b] : starts[b + 1]].float()  # [S, N, D]
        s = q.shape[0]
        if s == 0:
            continue
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        k = key[blocks].reshape(-1, kv_heads, d)[:kv_len].float()  # [KV_S, KV_N, D]
        v = value[blocks].reshape(-1, kv_heads, d)[:kv_len].float()
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("snd,knd->nsk", q, k) * scale  # [N, S, KV_S]
        if s > 1 and sparse_mode == 3:  # rightDownCausal: row i sees keys 0 .. kv_len - s + i
            hidden = torch.arange(kv_len)[None, :] > torch.arange(s)[:, None] + (kv_len - s)
            scores = scores.masked_fill(hidden, float("-inf"))
        elif sparse_mode == 0 and atten_mask is not None:  # defaultMask: 1 = not computed
            hidden = atten_mask[b if atten_mask.shape[0] > 1 else 0].reshape(s, -1)[:, :kv_len]
            scores = scores.masked_fill(hidden.bool().to(scores.device), float("-inf"))
        p = scores.softmax(-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("nsk,knd->snd", p, v).to(query.dtype)
    return out, query.new_zeros(0, dtype=torch.float32)


@_fia.register_fake
def _(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv, block_table,
      num_heads, scale, num_key_value_heads, sparse_mode, block_size):  # fmt: skip
    return torch.empty_like(query), query.new_empty(0, dtype=torch.float32)


def _check_fia(query, key, value, mask, q_ends, kv_lens, table, heads, kv_heads, sparse, bs):
    op = "npu_fused_infer_attention_score"
    if query.dim() != 3 or query.shape[1] != heads:
        refuse(op, f"TND query must be [T, num_heads={heads}, D], got {list(query.shape)}")
    if heads % kv_heads or heads // kv_heads > 64:
        refuse(op, "num_heads must be a multiple of num_key_value_heads, at most 64 times it")
    if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype:
        refuse(op, "page attention takes float16 or bfloat16 query, key and value of one dtype")
    d = query.shape[-1]
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != (bs, kv_heads * d):
        refuse(op, f"paged key/value must both be [blocknum, {bs}, {kv_heads * d}] (KV_N*D)")
    if table.dim() != 2 or table.dtype != torch.int32 or table.shape[0] != len(kv_lens):
        refuse(op, f"block_table must be 2-D int32 with one row per batch ({len(kv_lens)})")
    if len(q_ends) != len(kv_lens):
        refuse(op, "actual_seq_lengths and actual_seq_lengths_kv must give one value per batch")
    if bs <= 0 or bs % 16 or bs > 512:
        refuse(op, f"block_size must be a multiple of 16 in (0, 512], got {bs}")
    if list(q_ends) != sorted(q_ends) or (q_ends and (q_ends[0] < 0 or q_ends[-1] != len(query))):
        refuse(op, "TND actual_seq_lengths are cumulative query ends, the last one T")
    q_lens = [e - s for s, e in zip([0, *q_ends], q_ends, strict=False)]
    if max(q_lens, default=0) > 1:
        if bs % 128:
            refuse(
                op,
                f"with query rows > 1 and page attention, block_size must be a multiple of 128, got {bs}",
            )  # noqa: E501
        if sparse not in (0, 3):
            raise NotImplementedError(f"{op}: sparse_mode {sparse} is not emulated (0 or 3)")
        if sparse == 3 and (mask is None or tuple(mask.shape[-2:]) != (MASK_SIZE, MASK_SIZE)):
            refuse(op, f"sparse_mode 3 needs the optimised {MASK_SIZE}x{MASK_SIZE} causal mask")
        seen = _CHECKED_MASKS.get(id(mask))
        if sparse == 3 and (seen is None or seen() is not mask):  # 4M elements: once a mask
            want = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)
            if not torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), want):
                refuse(op, "the sparse_mode 3 mask must be ones above the diagonal, else zeros")
            _CHECKED_MASKS[id(mask)] = weakref.ref(mask)
    if mask is not None and sparse == 0:
        _check_default_mask(op, mask, q_lens, table.shape[1] * bs)
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if kv < n or kv > table.shape[1] * bs:
            refuse(
                op, f"batch {b}: actual_seq_lengths_kv {kv} must be in [{n}, {table.shape[1] * bs}]"
            )  # noqa: E501
        used = table[b, : -(-kv // bs)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= key.shape[0]):
            refuse(op, f"batch {b}: block_table holds a block id outside [0, {key.shape[0]})")


def _check_default_mask(op: str, mask, q_lens: list[int], table_width: int) -> None:
    """sparse_mode 0 with a mask (the decode form): bool/int8/uint8, ``(B, 1, Q_S, KV_S)`` or
    ``(1, 1, Q_S, KV_S)``, contiguous; with page attention its last dimension at least the
    block table's width times block_size. Emulated for decode rows (Q_S = 1) only."""
    if max(q_lens, default=0) > 1:
        raise NotImplementedError(f"{op}: a sparse_mode 0 mask is emulated for decode rows only")
    if mask.dtype not in (torch.bool, torch.int8, torch.uint8) or not mask.is_contiguous():
        refuse(op, "atten_mask must be a contiguous bool, int8 or uint8 tensor")
    if mask.dim() != 4 or mask.shape[0] not in (1, len(q_lens)) or mask.shape[1:3] != (1, 1):
        refuse(
            op, f"atten_mask must be (B, 1, Q_S, KV_S) or (1, 1, Q_S, KV_S), got {list(mask.shape)}"
        )
    if mask.shape[-1] < table_width:
        refuse(op, f"with page attention the mask's last dimension must be at least block_table "
                   f"width * block_size ({table_width}), got {mask.shape[-1]}")  # fmt: skip


UNEMULATED_FIA_ARGS = (
    "pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
    "quant_offset2", "antiquant_scale", "antiquant_offset", "query_padding_size",
    "kv_padding_size", "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "key_shared_prefix", "value_shared_prefix",
    "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale",
)  # fmt: skip


def npu_fused_infer_attention_score(
    query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
    block_table=None, num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
    input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
    softmax_lse_flag=False, **unemulated,
):  # fmt: skip
    """``torch_npu.npu_fused_infer_attention_score`` in its page-attention TND form:
    ``query [T, N, D]``, ``key``/``value`` the paged cache ``[blocknum, block_size, KV_N*D]``,
    ``block_table [B, max_blocks]`` int32, ``actual_seq_lengths`` the cumulative query ends,
    ``actual_seq_lengths_kv`` each batch's KV length. Returns ``(attention_out, lse)``."""
    named = [k for k, v in unemulated.items() if v is not None]
    if named or softmax_lse_flag or input_layout != "TND" or block_table is None:
        raise NotImplementedError(
            "npu_fused_infer_attention_score: only input_layout='TND' with page attention "
            f"(block_table) and no quantisation is emulated (got {input_layout!r}, {named})"
        )
    if actual_seq_lengths is None or actual_seq_lengths_kv is None:
        refuse("npu_fused_infer_attention_score", "TND and page attention need both lengths")
    return _fia(
        query, key, value, atten_mask, [int(x) for x in actual_seq_lengths],
        [int(x) for x in actual_seq_lengths_kv], block_table, num_heads, scale,
        num_key_value_heads, sparse_mode, block_size,
    )  # fmt: skip


def causal_mask() -> Tensor:
    """The optimised mask sparse_mode 3 takes: 2048 x 2048, 1 above the diagonal (int8)."""
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8).triu(1)


OPS = {
    "npu_rms_norm": npu_rms_norm,
    "npu_add_rms_norm": npu_add_rms_norm,
    "npu_swiglu": npu_swiglu,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_scatter_pa_kv_cache": npu_scatter_pa_kv_cache,
    "npu_fused_infer_attention_score": npu_fused_infer_attention_score,
}
