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


def read_bandwidth(device: torch.device, sync, mib: int = 512, repeats: int = 5) -> dict:
    """Bytes/s of a large copy (read + write traffic) and of a large fp32 sum (reads only);
    the floor uses the better of the two, the most this device was seen to move."""
    n = mib * 2**20
    src = torch.ones(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = 2 * n / _median_time(lambda: dst.copy_(src), repeats, sync)
    f32 = torch.ones(n // 4, device=device)
    read = n / _median_time(lambda: f32.sum(), repeats, sync)
    return {"copy_Bps": copy, "sum_read_Bps": read, "read_Bps": max(copy, read)}


def gemm_rate(
    device: torch.device,
    sync,
    rows: int,
    k: int = 2048,
    n: int = 5632,
    repeats: int = 3,
    linear=F.linear,
) -> float:
    """bf16 FLOP/s of ``linear`` (the model's projection kernel) with ``rows`` rows against a
    [n, k] weight."""
    x = torch.randn(rows, k, device=device).bfloat16()
    w = torch.randn(n, k, device=device).bfloat16()
    seconds = _median_time(lambda: linear(x, w), repeats, sync)
    return 2 * rows * k * n / seconds


def layer_weight_bytes(cfg: OuroConfig) -> int:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return 2 * cfg.num_hidden_layers * (attn + 3 * h * i + 4 * h)


def decode_bytes(cfg: OuroConfig, context: int) -> int:
    """One decode step: every loop re-reads the layers, then lm_head, then the KV it attends."""
    kv = 2 * cfg.num_planes * context * cfg.num_key_value_heads * cfg.head_dim * 2
    return cfg.total_ut_steps * layer_weight_bytes(cfg) + 2 * cfg.vocab_size * cfg.hidden_size + kv


def prefill_flops(cfg: OuroConfig, tokens: int) -> int:
    """Projection and MLP FLOPs of a prefill (attention scores excluded), plus one lm_head row."""
    per_token = cfg.total_ut_steps * layer_weight_bytes(cfg) // 2 * 2  # 2 FLOPs per weight
    return tokens * per_token + 2 * cfg.vocab_size * cfg.hidden_size
