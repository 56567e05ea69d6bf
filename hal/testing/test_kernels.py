"""Conformance checks of a driver's kernels (selected with --rlt-driver): each op's kernels
(linear, rms_norm, silu_mul, rotary) against float64 within bf16 rounding, every quantized linear
kernel (``hal.quant``: each scheme the driver runs, each group size) against
dequantize-then-matmul in float64, and the claims a kernel makes (HF-exact bits, row
invariance, column invariance on stacked weights) held exactly."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hal.kernels import adversarial_rows, adversarial_weight, check_rows
from hal.quant import (
    adversarial_qrows,
    adversarial_qweight,
    from_integers,
    quantize_activations,
    with_static_input,
)
from hal.reference import linear_f64, qlinear_f64, rand_bf16

# -- kernels --------------------------------------------------------------------------------


def _kernels(driver, op):
    """The driver's kernels for ``op`` that can run here (unavailable ones say why, in -rs)."""
    usable = [k for k in driver.kernels_for(op) if k.available() is None]
    assert usable, f"{op}: not even torch's form can run"
    return usable


def _quantized(driver):
    """``(scheme, group size, kernel)`` for every quantized linear kernel that can run here,
    at every group size of its scheme."""
    out = []
    for scheme in driver.quantization_schemes:
        usable = [k for k in driver.kernels_for("linear", scheme) if k.available() is None]
        assert usable, f"driver runs {scheme} but none of its {scheme} kernels can run here"
        out += [(scheme, g, k) for k in usable for g in ((None,) if scheme == "int8" else GROUPS)]
    return out


GROUPS = (32, 64, 128)


def _qweight(n: int, k: int, scheme: str, group: int | None, gen, dev):
    """Random values over the scheme's whole range, with scales that differ by up to 2^6
    between groups (a kernel applying one group's scale to another shows)."""
    lo, hi = (-8, 8) if scheme == "int4" else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=gen)
    groups = k // group if group else 1
    scale = torch.rand(n, groups, generator=gen) * 2.0 ** torch.randint(
        -9, -3, (n, groups), generator=gen
    )
    zero = None
    if scheme == "int8z":  # zero points over the whole range: q - z spans [-255, 255]
        zero = torch.randint(-128, 128, (n, groups), generator=gen)
    w = from_integers(q, scale if group else scale[:, 0], scheme, group, zero=zero)
    return _on(w, dev)


def _for(kernel, w, gen):
    """``w`` as ``kernel`` takes it: a W8A8 static kernel's with a calibrated input (a scale
    of 2^-5 to 2^-4, so that some of rand_bf16's inputs saturate, and a nonzero offset)."""
    if kernel.activations != "int8-static":
        return w
    scale = float(2.0**-5 * (1 + torch.rand(1, generator=gen)))
    offset = int(torch.randint(1, 10, (1,), generator=gen)) * (-1) ** int(w.shape[0])
    return with_static_input(w, scale, offset)


def _apply(fn, w, rows):
    return fn(rows, w)


def _on(w, dev):
    return w.to(dev)


def test_every_linear_kernel_is_within_bf16_rounding_of_float64(driver):
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(11)
    # Row counts of decode and prefill; N and K with tails that vectorised kernels must handle.
    for kernel in _kernels(driver, "linear"):
        for m, n, k in ((1, 96, 64), (3, 37, 203), (40, 64, 256)):
            x, w = rand_bf16(m, k, gen=gen).to(dev), rand_bf16(n, k, gen=gen).to(dev)
            got = kernel.fn(x, w)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16, kernel.name
            exact, bound = linear_f64(x, w)
            worst = ((got.double().cpu() - exact).abs() - bound).max().item()
            assert worst <= 0, f"{kernel.name}: {m}x{k} @ {k}x{n} exceeds the bound by {worst:.3g}"


def test_every_quantized_linear_kernel_is_within_rounding_of_dequantize_then_matmul(driver):
    """Each scheme the driver runs (``Driver.quantization_schemes``), each kernel, each group
    size: against ``x @ dequant(w).T`` in float64 (``hal.reference.qlinear_f64``; a kernel
    quantizing its activations, per block or per token, against ``x~ @ dequant(w).T`` with
    ``x~`` those activations: ``hal.quant.quantize_activations``). A driver
    that runs no scheme has nothing to check here (and is refused ``--quantization``)."""
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(21)
    bad: list[str] = []
    for scheme, group, kernel in _quantized(driver):
        shapes = [(1, 96, 256), (3, 37, 256), (40, 64, 384)]
        if scheme == "int8":
            shapes.append((3, 37, 203))  # a K tail
        for m, n, k in shapes:
            x = rand_bf16(m, k, gen=gen).to(dev)
            w = _for(kernel, _qweight(n, k, scheme, group, gen, dev), gen)
            got = kernel.fn(x, w)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16, kernel.name
            seen = x
            if kernel.activations != "bf16":  # per block of 32, per token or static
                static = None if w.static is None else w.static.to("cpu")
                seen = quantize_activations(x.cpu(), kernel.activations, static)
            exact, bound = qlinear_f64(seen, w)
            worst = ((got.double().cpu() - exact).abs() - bound).max().item()
            if worst > 0:  # every kernel is checked: the message names each that fails
                where = f"{kernel.name} (group {group}): {m}x{k} @ {k}x{n}"
                bad.append(f"{where} exceeds the bound by {worst:.3g}")
                break
    assert not bad, "; ".join(bad)


def test_every_rms_norm_kernel_is_close_to_float64(driver):
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(13)
    for kernel in _kernels(driver, "rms_norm"):
        for n, eps, scale in ((64, 1e-6, 3.0), (203, 1e-5, 1.0), (256, 1e-2, 1e-3)):
            x, w = rand_bf16(16, n, gen=gen, scale=scale).to(dev), rand_bf16(n, gen=gen).to(dev)
            got = kernel.fn(x, w, eps)
            assert got.shape == x.shape and got.dtype == torch.bfloat16, kernel.name
            xd = x.double().cpu()
            exact = w.double().cpu() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
            # HF's form rounds twice to bf16 (the normalised row, then the product): 2^-8 each.
            err = ((got.double().cpu() - exact).abs() - exact.abs() * 2.0**-7).max().item()
            assert err <= 1e-30, f"{kernel.name}: RMSNorm over {n} exceeds the bound by {err:.3g}"


def test_every_silu_mul_kernel_is_close_to_float64(driver):
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(14)
    for kernel in _kernels(driver, "silu_mul"):
        for m, i in ((1, 8), (5, 203), (16, 256)):
            both = rand_bf16(m, 2 * i, gen=gen, scale=4.0).to(dev)  # gate|up, as a stacked call
            gate, up = both[:, :i], both[:, i:]
            got = kernel.fn(gate, up)
            assert got.shape == (m, i) and got.dtype == torch.bfloat16, kernel.name
            g, u = gate.double().cpu(), up.double().cpu()
            exact = g * torch.sigmoid(g) * u
            # Two bf16 roundings (silu, then the product) and an fp32 exp: within 2^-7.
            err = ((got.double().cpu() - exact).abs() - exact.abs() * 2.0**-7).max().item()
            assert err <= 1e-30, f"{kernel.name}: {m}x{i} exceeds the bound by {err:.3g}"


def _rotary_call(fn, rows: torch.Tensor) -> torch.Tensor:
    """``fn`` on a step of ``rows [N, >= 192]``: each row carries its own query (2 heads of
    32), key (1 head), cos and sin, so that a row's result depends on that row alone."""
    n = rows.shape[0]
    q, k = rows[:, :64].view(n, 2, 32), rows[:, 64:96].view(n, 1, 32)
    q2, k2 = fn(q, k, rows[:, 128:160], rows[:, 160:192])
    return torch.cat((q2.reshape(n, -1), k2.reshape(n, -1)), dim=1)


def test_every_rotary_kernel_is_within_bf16_rounding_of_float64(driver):
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(17)
    for kernel in _kernels(driver, "rotary"):
        for n, hq, hk, d in ((1, 4, 4, 64), (5, 4, 2, 32), (3, 3, 1, 20)):
            qkv = rand_bf16(n, (hq + 2 * hk) * d, gen=gen, scale=3.0).to(dev)
            q, k = qkv[:, : hq * d].view(n, hq, d), qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
            cos, sin = rand_bf16(n, d, gen=gen).to(dev), rand_bf16(n, d, gen=gen).to(dev)
            got = kernel.fn(q, k, cos, sin)
            for x, y in zip((q, k), got, strict=True):
                assert y.shape == x.shape and y.dtype == torch.bfloat16, kernel.name
                xd, c, s_ = (t.double().cpu() for t in (x, cos[:, None], sin[:, None]))
                half = d // 2
                turned = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
                a, b = xd * c, turned * s_
                # Three bf16 roundings (each product, then the sum): within 2^-8 of each.
                bound = (a.abs() + b.abs()) * 2.0**-8 + (a + b).abs() * 2.0**-8
                err = ((y.double().cpu() - (a + b)).abs() - bound).max().item()
                where = f"{kernel.name}: rotary of {n}x{x.shape[1]}x{d}"
                assert err <= 1e-30, f"{where} exceeds the bound by {err:.3g}"


def test_kernels_that_claim_hf_exactness_give_the_bits_of_torchs_form(driver):
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(15)
    x, w = rand_bf16(7, 203, gen=gen).to(dev), rand_bf16(37, 203, gen=gen).to(dev)
    calls = {
        "linear": lambda fn: fn(x, w),
        "rms_norm": lambda fn: fn(x, w[0], 1e-6),
        "silu_mul": lambda fn: fn(x[:, :100], x[:, 100:200]),
        "rotary": lambda fn: _rotary_call(fn, x),
    }
    for op, call in calls.items():
        want = call(driver.kernel(op, "torch").fn)
        for kernel in _kernels(driver, op):
            if kernel.hf_exact:
                assert torch.equal(call(kernel.fn), want), f"{op} {kernel.name}"


def test_kernels_that_claim_row_invariance_keep_a_rows_bits_in_every_call(driver):
    # Any row count, any position, beside any rows: the claim is "by construction", so it is
    # checked on odd counts too, on inputs where any change of summation order shows.
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(16)
    counts = (1, 2, 3, 4, 5, 8, 13, 16, 31, 32)
    x = adversarial_rows(64, 203, gen).to(dev)
    w = adversarial_weight(37, 203, gen).to(dev)
    calls = {
        "linear": lambda fn: lambda rows: fn(rows, w),
        "rms_norm": lambda fn: lambda rows: fn(rows, w[0], 1e-6),
        "silu_mul": lambda fn: lambda rows: fn(rows[:, :101], rows[:, 101:202]),
        "rotary": lambda fn: lambda rows: _rotary_call(fn, rows),
    }
    for op, bind in calls.items():
        for kernel in _kernels(driver, op):
            if kernel.row_invariant:
                why = check_rows(bind(kernel.fn), x, counts)
                assert why is None, f"{op} {kernel.name} claims row invariance, but {why}"
    for scheme, group, kernel in _quantized(driver):
        if kernel.row_invariant:
            qw = _for(kernel, _on(adversarial_qweight(37, 256, scheme, group, gen), dev), gen)
            qx = adversarial_qrows(64, 256, scheme, gen).to(dev)
            why = check_rows(functools.partial(_apply, kernel.fn, qw), qx, counts)
            assert why is None, f"linear {kernel.name} claims row invariance, but {why}"


def test_kernels_that_claim_column_invariance_give_the_same_bits_on_stacked_weights(driver):
    # A runtime may call these kernels once on q|k|v and gate|up; the claim must hold exactly.
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(12)
    for kernel in _kernels(driver, "linear"):
        if not kernel.column_invariant:
            continue
        for m, k in ((1, 64), (5, 203), (40, 256)):
            x = rand_bf16(m, k, gen=gen).to(dev)
            parts = [rand_bf16(n, k, gen=gen).to(dev) for n in (96, 37, 37)]
            stacked = kernel.fn(x, torch.cat(parts))
            separate = torch.cat([kernel.fn(x, w) for w in parts], dim=-1)
            assert torch.equal(stacked, separate), f"{kernel.name}: {m} rows x K {k}"
    for scheme, group, kernel in _quantized(driver):
        if not kernel.column_invariant:
            continue
        for m in (1, 5, 40):
            x = rand_bf16(m, 256, gen=gen).to(dev)
            w = _for(kernel, _qweight(96 + 37 + 37, 256, scheme, group, gen, dev), gen)
            parts = [w.rows(0, 96), w.rows(96, 133), w.rows(133, 170)]  # stacked q|k|v
            separate = torch.cat([kernel.fn(x, p) for p in parts], dim=-1)
            assert torch.equal(kernel.fn(x, w), separate), f"{kernel.name}: {m} rows"


def test_every_bound_kernel_gives_its_kernels_bits(driver):
    """``Kernel.into`` (a kernel bound to its constants, writing into the caller's buffer: the
    runtime's bound decode loop calls it in place of ``fn``) gives ``fn``'s bits, on row counts
    of decode steps and odd ones, adversarial rows and every scheme and group size, with the
    output's extra rows left as they were."""
    dev = driver.device.torch_device
    gen = torch.Generator().manual_seed(18)
    x = adversarial_rows(13, 256, gen).to(dev)
    w = adversarial_weight(37, 256, gen).to(dev)
    cases: list[tuple[str, Any, tuple, Callable]] = [
        ("linear", k, (w,), lambda fn, rows, c: fn(rows, *c)) for k in _kernels(driver, "linear")
    ]
    cases += [
        ("rms_norm", k, (w[0], 1e-6), lambda fn, rows, c: fn(rows, *c))
        for k in _kernels(driver, "rms_norm")
    ]
    cases += [
        ("silu_mul", k, (), lambda fn, rows, c: fn(rows[:, :128], rows[:, 128:]))
        for k in _kernels(driver, "silu_mul")
    ]
    for scheme, group, kernel in _quantized(driver):
        qw = _for(kernel, _on(adversarial_qweight(37, 256, scheme, group, gen), dev), gen)
        cases.append((f"{scheme} (group {group})", kernel, (qw,), lambda fn, rows, c: fn(rows, *c)))
    for what, kernel, consts, call in cases:  # a driver need not bind any kernel
        if kernel.into is None:
            continue
        bound = kernel.into(*consts)
        for m in (1, 2, 3, 5, 8, 13):
            rows = x[:m].contiguous()
            want = call(kernel.fn, rows, consts)
            out = torch.full((m + 2, want.shape[1]), 7.0, dtype=want.dtype, device=dev)
            bound(out, rows)
            assert torch.equal(out[:m], want), f"{what} {kernel.name}: bound form, {m} rows"
            assert (out[m:] == 7.0).all(), f"{what} {kernel.name}: wrote past its {m} rows"
    for kernel in _kernels(driver, "rotary"):
        if kernel.into is None:
            continue
        for n, hq, hk, d in ((1, 4, 4, 64), (5, 4, 2, 32), (3, 3, 1, 20)):
            qkv = rand_bf16(n, (hq + 2 * hk) * d, gen=gen, scale=3.0).to(dev)
            q, k = qkv[:, : hq * d].view(n, hq, d), qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
            cos, sin = rand_bf16(n, d, gen=gen).to(dev), rand_bf16(n, d, gen=gen).to(dev)
            want = kernel.fn(q, k, cos, sin)
            got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
            kernel.into()(got, q, k, cos, sin)
            assert all(map(torch.equal, got, want)), f"rotary {kernel.name}: bound form, {n} rows"
