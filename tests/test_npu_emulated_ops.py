"""The EMULATED fused torch_npu ops (a test double for Ascend hardware, ``drivers.npu.fused_ops``).

Each emulated op is checked against a plain torch composition written here, values and
meta shapes (torch_npu's meta functions' rules); each check is shown to catch a planted bug
(a test double that passes its own bug proves nothing). Nothing here is a hardware result.
Their admission at start-up and the fast plan built on them: ``test_npu_fused``.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from drivers.npu import fused_ops as npu
from drivers.npu.emulation import EmulatedTorchNpu
from hal.devops import DeviceOpCounter
from hal.kernels import hf_rms_norm

BF16 = torch.bfloat16


def _r(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


# -- each op against a torch composition (and the planted bug it must catch) ----------------


def rms_norm_problem(op) -> str | None:
    x, w = _r(4, 3, 64, seed=1, scale=3.0), _r(64, seed=2)
    y, rstd = op(x, w, 1e-6)
    xf = x.float()
    want_rstd = 1.0 / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    want = (xf * want_rstd * w.float()).to(BF16)
    if rstd.shape != (4, 3, 1) or rstd.dtype != torch.float32:
        return f"rstd is {list(rstd.shape)} {rstd.dtype}, not [4, 3, 1] float32"
    if (y.float() - want.float()).abs().max() > 2**-7 * want.float().abs().max():
        return "y differs from x * rsqrt(mean(x^2) + eps) * gamma"
    return None


def add_rms_norm_problem(op) -> str | None:
    x1, x2, w = _r(5, 64, seed=3), _r(5, 64, seed=4, scale=2.0), _r(64, seed=5)
    y, rstd, total = op(x1, x2, w, 1e-6)
    if not torch.equal(total, x1 + x2):
        return "the third output is not x1 + x2"
    if rstd.shape != (5, 1):
        return f"rstd is {list(rstd.shape)}"
    if not torch.equal(y, npu.npu_rms_norm(x1 + x2, w, 1e-6)[0]):
        return "y is not rms_norm(x1 + x2)"
    return None


def swiglu_problem(op) -> str | None:
    x = _r(3, 2, 40, seed=6, scale=3.0)
    a, b = x[..., :20].float(), x[..., 20:].float()
    want = (torch.nn.functional.silu(a) * b).to(BF16)
    got = op(x, -1)
    if got.shape != (3, 2, 20) or (got.float() - want.float()).abs().max() > 2**-7 * 8:
        return "not silu(first half) * second half"
    return None


def rotary_problem(op) -> str | None:
    x = _r(1, 6, 4, 32, seed=7)
    cos, sin = _r(1, 6, 1, 32, seed=8).clamp(-1, 1), _r(1, 6, 1, 32, seed=9).clamp(-1, 1)
    half = torch.cat((-x[..., 16:], x[..., :16]), -1).float()
    want = (x.float() * cos.float() + half * sin.float()).to(BF16)
    got = op(x, cos, sin)
    if got.shape != x.shape or not torch.allclose(got.float(), want.float(), atol=2**-6):
        return "not x * cos + rotate_half(x) * sin"
    return None


def scatter_problem(op) -> str | None:
    kc, vc = torch.zeros(4, 16, 2, 8, dtype=BF16), torch.zeros(4, 16, 2, 8, dtype=BF16)
    k, v = _r(3, 2, 8, seed=10), _r(3, 2, 8, seed=11)
    slots = torch.tensor([17, 0, 63])
    op(k, v, kc, vc, slots, cache_mode="Norm")
    for i, s in enumerate(slots.tolist()):
        if not (torch.equal(kc[s // 16, s % 16], k[i]) and torch.equal(vc[s // 16, s % 16], v[i])):
            return f"row {i} is not at slot {s} (block {s // 16}, offset {s % 16})"
    if kc.count_nonzero() != k.count_nonzero():
        return "rows were written outside their slots"
    return None


def _paged_case(block_size=128, q_lens=(3, 1), ctx=(130, 7), heads=4, kv_heads=2, d=32):
    """A paged cache, block tables that are not the identity, and the plain composition."""
    nb = 6
    kc, vc = _r(nb, block_size, kv_heads * d, seed=12), _r(nb, block_size, kv_heads * d, seed=13)
    tables = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
    kv_lens = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    q = _r(sum(q_lens), heads, d, seed=14)
    want, start = [], 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        rows = [tables[b, p // block_size] * block_size + p % block_size for p in range(kv)]
        k = kc.view(-1, kv_heads, d)[torch.tensor(rows)].float().repeat_interleave(2, 1)
        v = vc.view(-1, kv_heads, d)[torch.tensor(rows)].float().repeat_interleave(2, 1)
        s = torch.einsum("snd,knd->nsk", q[start : start + n].float(), k) * d**-0.5
        hidden = torch.arange(kv)[None] > torch.arange(n)[:, None] + kv - n
        p = s.masked_fill(hidden, float("-inf")).softmax(-1)
        want.append(torch.einsum("nsk,knd->snd", p, v))
        start += n
    args = (q, kc, vc)
    kwargs = dict(
        atten_mask=npu.causal_mask(), actual_seq_lengths=list(torch.tensor(q_lens).cumsum(0)),
        actual_seq_lengths_kv=kv_lens, block_table=tables, num_heads=heads, scale=d**-0.5,
        input_layout="TND", num_key_value_heads=kv_heads, sparse_mode=3, block_size=block_size,
    )  # fmt: skip
    return args, kwargs, torch.cat(want)


def fia_problem(op) -> str | None:
    args, kwargs, want = _paged_case()
    out, lse = op(*args, **kwargs)
    if out.shape != args[0].shape or lse.shape != (0,):
        return f"shapes {list(out.shape)}, {list(lse.shape)}"
    if (out.float() - want).abs().max() > 0.02:
        return "attention differs from softmax(q k^T * scale, right-down causal) v over the pages"
    return None


def _decode_case(block_size=128, ctx=(130, 6, 300), width=4, heads=4, kv_heads=2, d=32):
    """The decode form ascend_fia passes (and step graphs capture): one row per request, a
    block table as wide as the context bucket whose spare entries repeat the first block, the
    bucket as every KV length and a mask past each row's context (sparse_mode 0)."""
    nb = 8
    kc, vc = _r(nb, block_size, kv_heads * d, seed=22), _r(nb, block_size, kv_heads * d, seed=23)
    used = [[5, 2], [7], [1, 6, 3]]
    tables = torch.tensor([u + u[:1] * (width - len(u)) for u in used], dtype=torch.int32)
    q = _r(len(ctx), heads, d, seed=24)
    want = []
    for b, c in enumerate(ctx):
        rows = [tables[b, p // block_size] * block_size + p % block_size for p in range(c + 1)]
        k = kc.view(-1, kv_heads, d)[torch.tensor(rows)].float().repeat_interleave(2, 1)
        v = vc.view(-1, kv_heads, d)[torch.tensor(rows)].float().repeat_interleave(2, 1)
        p = (torch.einsum("snd,knd->nsk", q[b : b + 1].float(), k) * d**-0.5).softmax(-1)
        want.append(torch.einsum("nsk,knd->snd", p, v))
    positions = torch.arange(width * block_size)
    mask = (positions[None] > torch.tensor(ctx)[:, None]).view(len(ctx), 1, 1, -1)
    kwargs = dict(
        atten_mask=mask, actual_seq_lengths=list(range(1, len(ctx) + 1)),
        actual_seq_lengths_kv=[width * block_size] * len(ctx), block_table=tables,
        num_heads=heads, scale=d**-0.5, input_layout="TND", num_key_value_heads=kv_heads,
        sparse_mode=0, block_size=block_size,
    )  # fmt: skip
    return (q, kc, vc), kwargs, torch.cat(want)


def fia_decode_problem(op) -> str | None:
    args, kwargs, want = _decode_case()
    out, _ = op(*args, **kwargs)
    if (out.float() - want).abs().max() > 0.02:
        return "masked decode attention differs from softmax over each row's own context"
    return None


def _fia_ignoring_the_mask(q, k, v, **kw):
    return npu.npu_fused_infer_attention_score(q, k, v, **{**kw, "atten_mask": None})


def _swapped_swiglu(x, dim):
    a, b = x.chunk(2, dim)
    return npu.npu_swiglu(torch.cat((b, a), dim), dim)


def _sign_flipped_rotary(x, r1, r2):
    return npu.npu_rotary_mul(x, r1, -r2)


def _off_by_one_scatter(k, v, kc, vc, slots, cache_mode=None):
    npu.npu_scatter_pa_kv_cache(k, v, kc, vc, (slots + 1) % 64, cache_mode=cache_mode)


def _fia_ignoring_block_table(q, k, v, **kw):
    return npu.npu_fused_infer_attention_score(
        q, k, v, **{**kw, "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}
    )


def _fia_ignoring_kv_lengths(q, k, v, **kw):
    full = [kw["block_table"].shape[1] * kw["block_size"]] * len(kw["actual_seq_lengths_kv"])
    return npu.npu_fused_infer_attention_score(q, k, v, **{**kw, "actual_seq_lengths_kv": full})


CASES = {
    "npu_rms_norm": (rms_norm_problem, npu.npu_rms_norm, lambda x, w, e: (hf_rms_norm(x, w, e) * 1.02, npu.npu_rms_norm(x, w, e)[1])),  # noqa: E501
    "npu_add_rms_norm": (add_rms_norm_problem, npu.npu_add_rms_norm, lambda a, b, w, e: (*npu.npu_add_rms_norm(a, b, w, e)[:2], a)),  # noqa: E501
    "npu_swiglu": (swiglu_problem, npu.npu_swiglu, _swapped_swiglu),
    "npu_rotary_mul": (rotary_problem, npu.npu_rotary_mul, _sign_flipped_rotary),
    "npu_scatter_pa_kv_cache": (scatter_problem, npu.npu_scatter_pa_kv_cache, _off_by_one_scatter),  # noqa: E501
    "fia_block_table": (fia_problem, npu.npu_fused_infer_attention_score, _fia_ignoring_block_table),  # noqa: E501
    "fia_kv_lengths": (fia_problem, npu.npu_fused_infer_attention_score, _fia_ignoring_kv_lengths),  # noqa: E501
    "fia_decode_mask": (fia_decode_problem, npu.npu_fused_infer_attention_score, _fia_ignoring_the_mask),  # noqa: E501
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_each_emulated_op_matches_its_torch_composition_and_the_check_catches_a_planted_bug(name):
    problem, op, planted = CASES[name]
    assert problem(op) is None
    assert problem(planted) is not None, f"{name}: the check misses its planted bug"


def test_the_emulated_ops_meta_shapes_are_torch_npus():
    with FakeTensorMode():
        x, w = torch.empty(2, 7, 64, dtype=BF16), torch.empty(64, dtype=BF16)
        y, rstd = npu.npu_rms_norm(x, w)
        assert (y.shape, rstd.shape, rstd.dtype) == (x.shape, (2, 7, 1), torch.float32)
        assert [t.shape for t in npu.npu_add_rms_norm(x, x, w)] == [x.shape, (2, 7, 1), x.shape]
        assert npu.npu_swiglu(torch.empty(3, 11, 10), dim=1).shape == (3, 5, 10)  # floor(11/2)
        r = torch.empty(1, 7, 1, 64, dtype=BF16)
        assert npu.npu_rotary_mul(torch.empty(1, 7, 4, 64, dtype=BF16), r, r).shape == (1, 7, 4, 64)  # noqa: E501
        q = torch.empty(5, 4, 32, dtype=BF16)
        out, lse = torch.ops.rlt_npu_emulated.npu_fused_infer_attention_score(
            q, torch.empty(2, 128, 64, dtype=BF16), torch.empty(2, 128, 64, dtype=BF16), None,
            [5], [5], torch.empty(1, 2, dtype=torch.int32), 4, 0.1, 2, 3, 128,
        )  # fmt: skip
        assert out.shape == q.shape and lse.shape == (0,)


def test_the_emulated_ops_enforce_torch_npus_documented_rules():
    kc = torch.zeros(2, 16, 2, 8, dtype=BF16)
    k = _r(4, 2, 8)
    with pytest.raises(RuntimeError, match="inputs must be contiguous"):
        npu.npu_scatter_pa_kv_cache(
            k[::2], k[::2], kc, kc.clone(), torch.tensor([0, 1]), cache_mode="Norm"
        )  # noqa: E501
    with pytest.raises(RuntimeError, match="must not repeat"):
        npu.npu_scatter_pa_kv_cache(
            k, k, kc, kc.clone(), torch.tensor([0, 1, 1, 2]), cache_mode="Norm"
        )  # noqa: E501
    with pytest.raises(NotImplementedError, match="NZ format"):
        npu.npu_scatter_pa_kv_cache(k, k, kc, kc.clone(), torch.tensor([0, 1, 2, 3]))
    args, kwargs, _ = _paged_case(block_size=128)
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 128"):
        q, kc, vc = args
        npu.npu_fused_infer_attention_score(
            q, kc.view(12, 64, -1), vc.view(12, 64, -1), **{**kwargs, "block_size": 64}
        )  # noqa: E501
    with pytest.raises(RuntimeError, match="2048x2048 causal mask"):
        npu.npu_fused_infer_attention_score(*args, **{**kwargs, "atten_mask": None})
    with pytest.raises(NotImplementedError, match="only input_layout='TND'"):
        npu.npu_fused_infer_attention_score(*args, **{**kwargs, "input_layout": "BSND"})


def test_a_dispatch_mode_sees_one_device_op_per_emulated_kernel_and_no_view():
    x, w = _r(3, 64), _r(64)
    with DeviceOpCounter() as ops:
        npu.npu_rms_norm(x.view(3, 1, 64), w)
        x.transpose(0, 1)
    assert dict(ops.by_name) == {"rlt_npu_emulated.npu_rms_norm": 1}
    assert sum(ops.views.values()) == 2
    # The older emulated op (plain torch ops checking torch_npu's rules) counts once as well.
    target, index, rows = torch.zeros(8, 2, dtype=BF16), torch.tensor([[1], [3]]), _r(2, 2)
    with DeviceOpCounter() as ops:
        EmulatedTorchNpu().npu_scatter_nd_update_(target, index, rows)
    assert dict(ops.by_name) == {"torch_npu.npu_scatter_nd_update_": 1}
