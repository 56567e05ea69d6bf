"""What the hardware allows: measured read bandwidth and bf16 GEMM rate, and the floors of a
decode step (bytes it must move) and of a prefill (FLOPs it must do)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from runtime_glue.ouro.config import OuroConfig


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(
    device: torch.device, sync, mib: int = 512, repeats: int = 5, decode_linear=None, scheme="bf16"
) -> dict:
    """Bytes/s of a large copy (read + write traffic), of a large fp32 sum (reads only) and,
    given the plan's decode projection kernel ``decode_linear(x, w)``, of that kernel on one
    row against a ``mib`` weight in its ``scheme``: it reads the way the fastest kernel reads
    (every thread, its own loads). The floor uses the best of them, the most this device was
    seen to move, so that a TPOT below "1x floor" cannot happen."""
    n = mib * 2**20
    src = torch.ones(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = 2 * n / _median_time(lambda: dst.copy_(src), repeats, sync)
    f32 = torch.ones(n // 4, device=device)
    read = n / _median_time(lambda: f32.sum(), repeats, sync)
    out = {"copy_Bps": copy, "sum_read_Bps": read}
    if decode_linear is not None:
        w = _big_weight(n, scheme, device)
        x = torch.randn(1, w.shape[1], device=device).bfloat16()
        out["kernel_read_Bps"] = w.nbytes / _median_time(lambda: decode_linear(x, w), repeats, sync)
    out["read_Bps"] = max(out.values())
    return out


def _big_weight(nbytes: int, scheme: str, device: torch.device, k: int = 2048):
    """A weight of about ``nbytes`` in ``scheme`` (random values: only its bytes matter)."""
    from hal.quant import QuantizedWeight

    if scheme == "bf16":
        return torch.randn(nbytes // (2 * k), k, device=device).bfloat16()
    per_row = k // 2 if scheme == "int4" else k
    n = nbytes // per_row
    group = k if scheme == "int8" else 32
    if scheme == "int4":
        q = torch.randint(0, 256, (n, per_row), dtype=torch.uint8, device=device)
    else:  # the range rlt-hal's own quantization gives, [-127, 127]
        q = torch.randint(-127, 128, (n, per_row), dtype=torch.int8, device=device)
    scale = (torch.rand(n, k // group, device=device) * 0.01).bfloat16()
    return QuantizedWeight(scheme, q, scale[:, 0] if scheme == "int8" else scale, group, k)


def gemm_rate(
    device: torch.device,
    sync,
    rows: int,
    k: int = 2048,
    n: int = 5632,
    repeats: int = 3,
    linear=F.linear,
    quantized: tuple[str, int] | None = None,
) -> float:
    """FLOP/s of ``linear`` (the model's projection kernel) with ``rows`` bf16 rows against a
    [n, k] weight: bf16, or ``quantized`` ``(scheme, group size)`` as the model's are."""
    from hal.quant import quantize

    x = torch.randn(rows, k, device=device).bfloat16()
    dense = torch.randn(n, k, device=device).bfloat16()
    w = dense if quantized is None else quantize(dense, *quantized)
    seconds = _median_time(lambda: linear(x, w), repeats, sync)
    return 2 * rows * k * n / seconds


def layer_weight_bytes(cfg: OuroConfig) -> int:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return 2 * cfg.num_hidden_layers * (attn + 3 * h * i + 4 * h)


def weight_bytes_per_token(cfg: OuroConfig, weights: dict | None = None) -> int:
    """The weight bytes one decode step reads: every loop re-reads the layers, then lm_head.
    Counted from the loaded ``weights`` (quantized ones by their packed bytes and scales);
    without them, the bf16 checkpoint's."""
    if weights is None:
        return cfg.total_ut_steps * layer_weight_bytes(cfg) + 2 * cfg.vocab_size * cfg.hidden_size
    from runtime_glue.ouro.quantize import weight_bytes

    layers = weight_bytes({n: w for n, w in weights.items() if n.startswith("model.layers.")})
    return cfg.total_ut_steps * layers + weights["lm_head.weight"].nbytes


def decode_bytes(cfg: OuroConfig, context: int, weights: dict | None = None) -> int:
    """One decode step: the weights it reads (``weight_bytes_per_token``), then the KV it
    attends."""
    kv = 2 * cfg.num_planes * context * cfg.num_key_value_heads * cfg.head_dim * 2
    return weight_bytes_per_token(cfg, weights) + kv


def prefill_flops(cfg: OuroConfig, tokens: int) -> int:
    """Projection and MLP FLOPs of a prefill (attention scores excluded), plus one lm_head row."""
    per_token = cfg.total_ut_steps * layer_weight_bytes(cfg) // 2 * 2  # 2 FLOPs per weight
    return tokens * per_token + 2 * cfg.vocab_size * cfg.hidden_size
