"""Arithmetic every driver shares: HF-order eager attention over gathered pages and the
paged KV store on plain tensors.

Bit-exactness with Hugging Face's ``eager_attention_forward`` depends not only on the order of
operations but on the shapes and layouts handed to each matmul, so this module reproduces
HF's per-request shapes: ``q [1, heads, q_len, d]`` against ``k, v [1, heads, kv_len, d]``,
one request at a time, each query row seeing exactly its own context.
"""

from __future__ import annotations

import torch

from hal.graphs import StaticDecodeMetadata
from hal.interfaces import AttentionBackend, KVStore
from hal.types import AttentionMetadata, KVLayout


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[1, kv_heads, S, d]`` -> ``[1, kv_heads * n_rep, S, d]``, as HF materialises it."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


def causal_mask(q_len: int, context_len: int, dtype: torch.dtype, device: torch.device):
    """Additive mask ``[1, 1, q_len, context_len + q_len]``: 0 where allowed, finfo.min where not.

    Query row i sits at position ``context_len + i`` and sees keys ``0 .. context_len + i``.
    """
    kv_len = context_len + q_len
    rows = torch.arange(q_len, device=device)[:, None] + context_len
    cols = torch.arange(kv_len, device=device)[None, :]
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    mask.masked_fill_(cols > rows, torch.finfo(dtype).min)
    return mask[None, None]


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, context_len: int
) -> torch.Tensor:
    """HF eager order for one request. q ``[1, H, S, d]``, k/v ``[1, Hkv, kv_len, d]``.

    Returns ``[1, S, H, d]`` contiguous, as HF hands it to o_proj.
    """
    n_rep = q.shape[1] // k.shape[1]
    k = repeat_kv(k, n_rep)
    v = repeat_kv(v, n_rep)
    s = torch.matmul(q, k.transpose(2, 3)) * scaling  # [1, H, S, kv_len], bf16 then rounded
    q_len = q.shape[2]
    if q_len > 1:
        # A one-row query sees its whole context; adding a zero mask would change no bit.
        s = s + causal_mask(q_len, context_len, s.dtype, s.device)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(p, v)  # [1, H, S, d]
    return o.transpose(1, 2).contiguous()


def paged_attention(
    query: torch.Tensor,
    plane: int,
    kv: KVStore,
    meta: AttentionMetadata,
    scaling: float,
    attend=eager_attention,
    deterministic: bool = False,
) -> torch.Tensor:
    """Per-request attention over K/V gathered from ``plane`` of the paged cache.

    ``attend(q, k, v, scaling, context_len) -> [1, S, H, d]`` does the arithmetic for one
    request (HF eager order by default); this loop owns paging and slicing. In deterministic
    mode every backend runs ``row_invariant_attention`` instead.
    """
    _, heads, num_tokens, d = query.shape
    out = query.new_empty(num_tokens, heads * d)
    for r in range(meta.num_requests):
        start, q_len, context_len = meta.request(r)
        q = query[:, :, start : start + q_len, :]
        k, v = kv.gather(plane, meta.request_slots(r))
        if deterministic:
            row_invariant_attention(q, k, v, scaling, context_len, out[start : start + q_len])
            continue
        o = attend(q, k, v, scaling, context_len)
        out[start : start + q_len] = o.view(q_len, heads * d)
    return out


CHUNK = 16  # positions: every length a deterministic reduction runs over is a multiple of it


def row_invariant_attention(q, k, v, scaling: float, context_len: int, out: torch.Tensor) -> None:
    """Deterministic mode: each query row as a decode step computes it, into ``out [S, H*d]``.

    The row at position ``p`` is computed alone against positions ``0..p``, in fp32, by
    :func:`padded_attention` over its context padded to a multiple of ``CHUNK``: arithmetic
    whose bits depend on neither the chunk or batch the row arrived in nor how far its context
    is padded (a step graph pads every row to its bucket). GQA groups query heads instead of
    materialising ``repeat_kv``. The bits are not HF's (which runs bf16 matmuls); see
    docs/determinism.md.
    """
    _, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    # [q_len, kv_heads, n_rep, d], contiguous: row i's block has the same layout for any q_len.
    qf = q[0].transpose(0, 1).contiguous().float() * scaling
    qf = qf.view(q_len, kv_heads, heads // kv_heads, d)
    padded = -(-kv_len // CHUNK) * CHUNK  # the fp32 upcast, padded with zeros, once
    kf = k.new_zeros(1, kv_heads, padded, d, dtype=torch.float32)
    vf = torch.zeros_like(kf)
    kf[:, :, :kv_len], vf[:, :, :kv_len] = k, v
    for i in range(q_len):
        n = context_len + i + 1
        length = -(-n // CHUNK) * CHUNK
        masked = torch.arange(length, device=q.device) >= n
        o = padded_attention(qf[i : i + 1], kf[:, :, :length], vf[:, :, :length], masked)
        out[i] = o.reshape(heads * d)


def padded_attention(qf, kf, vf, masked: torch.Tensor) -> torch.Tensor:
    """fp32 attention of rows over padded contexts, in ops whose bits per row depend on
    neither the number of rows nor the padding: ``qf [R, Hkv, n_rep, d]`` (scaled), ``kf, vf
    [R, Hkv, L, d]`` with ``L`` a multiple of ``CHUNK``, ``masked`` (broadcast to
    ``[R, Hkv, n_rep, L]``) true past each row's context. Returns ``[R, Hkv, n_rep, d]``.

    torch's fp32 GEMM and softmax on the CPU change their low bits with the length they run
    over, so: scores as products summed over ``d`` (a reduction of fixed length); the softmax's
    max (exact in any order) and exp elementwise; every sum over positions as sums of
    ``CHUNK`` positions (fixed shapes) accumulated chunk after chunk by ``cumsum`` (in order,
    so a padded chunk adds an exact zero at the end). Every length is a multiple of ``CHUNK``,
    so no element falls in a vector loop's scalar tail.
    """
    rows, kv_heads, length, d = kf.shape
    chunks = length // CHUNK
    s = (qf[:, :, :, None, :] * kf[:, :, None]).sum(-1)  # [R, Hkv, n_rep, L]
    s = s.masked_fill(masked, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    total = torch.cumsum(e.view(*e.shape[:-1], chunks, CHUNK).sum(-1), -1)[..., -1:]
    p = (e / total).view(rows, kv_heads, -1, chunks, CHUNK).transpose(2, 3).contiguous()
    pv = torch.matmul(p, vf.view(rows, kv_heads, chunks, CHUNK, d))  # [R, Hkv, chunks, n_rep, d]
    return torch.cumsum(pv, 2)[:, :, -1]


def paged_eager_attention(query, plane, kv, meta, scaling, deterministic=False) -> torch.Tensor:
    """HF-order eager attention over the paged cache (what every ``*_eager`` backend runs)."""
    return paged_attention(query, plane, kv, meta, scaling, eager_attention, deterministic)


class EagerBackend(AttentionBackend):
    """HF eager order over gathered pages; drivers subclass it only to give it their name."""

    name = "eager"
    hf_exact = True
    supports_deterministic = True
    step_graphs = True

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        if isinstance(meta, StaticDecodeMetadata):  # a captured decode step (hal.graphs)
            return static_decode_attention(query, plane, kv, meta, scaling, deterministic)
        return paged_eager_attention(query, plane, kv, meta, scaling, deterministic)


def static_decode_attention(
    query: torch.Tensor,
    plane: int,
    kv: KVStore,
    meta: StaticDecodeMetadata,
    scaling: float,
    deterministic: bool = False,
) -> torch.Tensor:
    """Decode attention in static shapes, for step graphs: every row at once over its padded
    context bucket, masked past its ``seq_len``. ``query [1, H, B, d]`` -> ``[B, H * d]``.

    The same arithmetic per row as :func:`eager_attention` (HF order, bf16 matmuls: a masked
    position adds an exact zero to every sum) or, in deterministic mode,
    :func:`row_invariant_attention` (fp32, :func:`padded_attention`). ``tests/test_step_graphs.py`` checks the bits against the eager
    forms; a new platform must pass that check before its graphs are trusted.
    """
    _, heads, rows, d = query.shape
    k, v = kv.gather(plane, meta.gather_slots)  # [1, Hkv, B * C, d]
    kv_heads, context = k.shape[1], meta.context
    k = k.view(kv_heads, rows, context, d).transpose(0, 1)  # [B, Hkv, C, d]
    v = v.view(kv_heads, rows, context, d).transpose(0, 1)
    q = query[0].transpose(0, 1)  # [B, H, d]
    if deterministic:
        qf = q.contiguous().float() * scaling
        qf = qf.view(rows, kv_heads, heads // kv_heads, d)  # [B, Hkv, n_rep, d]
        o = padded_attention(qf, k.float().contiguous(), v.float().contiguous(), meta.masked)
        return o.reshape(rows, heads * d).to(query.dtype)
    n_rep = heads // kv_heads
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # [B, H, C, d]
    s = torch.matmul(q[:, :, None], k.transpose(2, 3)) * scaling  # [B, H, 1, C]
    s = s.masked_fill(meta.masked, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(p, v)  # [B, H, 1, d]
    return o.transpose(1, 2).reshape(rows, heads * d)


class TensorKVStore(KVStore):
    """Paged K/V on plain torch tensors: ``[planes, num_blocks * block_size, kv_heads, d]``.

    Subclasses choose how rows are written (``index_put_`` on CPU/CUDA, ScatterND on Ascend).
    """

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        super().__init__(layout, device)
        shape = (layout.num_planes, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self.key_cache = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.value_cache = torch.zeros(shape, dtype=layout.dtype, device=device)

    def _write_rows(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        cache.index_put_((slots,), rows)

    def rows(self, cache: torch.Tensor, plane: int = 0) -> torch.Tensor:
        """``cache`` as ``[rows, kv_heads, d]`` from plane ``plane`` on: slot ``s`` of that
        plane is row ``s``, later planes follow (a view, no copy)."""
        return cache.view(-1, *cache.shape[2:])[plane * self.layout.num_slots :]

    def write(self, plane, key, value, slots):
        self._write_rows(self.rows(self.key_cache, plane), slots, key)
        self._write_rows(self.rows(self.value_cache, plane), slots, value)

    def gather(self, plane, slots):
        k = self.rows(self.key_cache, plane).index_select(0, slots)  # [len, kv_heads, d]
        v = self.rows(self.value_cache, plane).index_select(0, slots)
        return k.transpose(0, 1).contiguous()[None], v.transpose(0, 1).contiguous()[None]
