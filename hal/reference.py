"""Float64 references: the yardsticks the kit measures every backend and kernel against, and
the seeded inputs of its checks.

They live in hal, not in ``hal.testing``: ``--mode fast`` admits a fused kernel on the device
by the same bounds (``runtime_glue/ouro/admission.py``), and the runtime imports no test kit."""

from __future__ import annotations

import torch

# Elementwise |out - ref| <= BOUND * max|v|. bf16 rounds the scores, the probabilities and the
# output; cpu_eager's worst case over 80 random shapes was 0.022 (2026-12-02).
ATTENTION_BOUND = 0.05


def linear_f64(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ w.T`` in float64, and the elementwise bound a bf16 kernel must stay within.

    A kernel that sums in fp32 and rounds once to bf16 is off by at most half a bf16 ulp of
    the result (2^-9 relative, bounded by 2^-8) plus fp32 accumulation error, which
    ``k * 2^-24 * sum|x * w|`` bounds whatever the summation order.
    """
    x64, w64 = x.double().cpu(), w.double().cpu()
    exact = x64 @ w64.T
    bound = exact.abs() * 2.0**-8 + x.shape[-1] * 2.0**-24 * (x64.abs() @ w64.abs().T)
    return exact, bound


def qlinear_f64(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ dequant(w).T`` in float64 for a ``hal.quant.QuantizedWeight``, and the bound a
    quantized kernel must stay within: ``linear_f64``'s, plus half a bf16 ulp of every
    product, for kernels that round the dequantized weight to bf16 before multiplying (the
    reference does: ``F.linear`` on ``w.dequantize()``)."""
    x64, w64 = x.double().cpu(), w.dequantize(torch.float64).cpu()
    exact = x64 @ w64.T
    sums = x64.abs() @ w64.abs().T
    bound = exact.abs() * 2.0**-8 + (x.shape[-1] * 2.0**-24 + 2.0**-9) * sums
    return exact, bound


def attention_f64(q, k, v, scaling: float, context_len: int) -> torch.Tensor:
    """q ``[1, H, S, d]``, k/v ``[1, Hkv, kv, d]`` -> ``[S, H * d]`` in float64, causal."""
    heads, s = q.shape[1], q.shape[2]
    rep = heads // k.shape[1]
    k = k.double().repeat_interleave(rep, 1)
    v = v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(2, 3) * scaling
    kv_len = k.shape[2]
    hidden = torch.arange(kv_len)[None, :] > (torch.arange(s)[:, None] + context_len)
    scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    out = scores.softmax(-1) @ v  # [1, H, S, d]
    return out[0].transpose(0, 1).reshape(s, -1)


def rand_bf16(*shape, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal bf16 inputs (on the CPU) of the kit's checks."""
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()
