"""One loop of Ouro's layers in the fast plan: fused kernels where the plan admitted them.

    x = ln_0(h)                                        # once per loop
    for l in 0..L-1:
        q|k|v = qkv_proj(x); q, k = rotary(q, k)       # one rotary call on q|k
        write k, v; a = o_proj(attention(q))           # the backend's cache write + attention
        x, h = add_rms_norm(ln2_l(a), h, post_ln_l)    # h += ln2(a); x = post_ln(h)
        m = down(swiglu(gate_up(x)))
        x, h = add_rms_norm(post_ln2_l(m), h, next)    # h += post_ln2(m); x = next norm of h
    return x                                           # next = ln_{l+1}, or the loop's norm

The arithmetic is the model's (``runtime_glue.ouro.model``); only the grouping differs: a
residual add is fused with the norm that follows it, which is the next layer's input norm
or, after the last layer, the loop's final norm (whose output is the next loop's state).
Every op runs the kernel the plan names (torch's form where a fused kernel was refused).
"""

from __future__ import annotations

import torch

from hal.interfaces import Driver
from hal.types import KVAddressing
from runtime_glue.ouro.plan import ExecutionPlan


class FusedLoop:
    def __init__(self, model, plan: ExecutionPlan, driver: Driver) -> None:
        self.model = model
        fused = dict(plan.fused)
        self.add_rms_norm = driver.kernel("add_rms_norm", fused["add_rms_norm"]).fn
        self.rotary = driver.kernel("rotary", fused["rotary"]).fn

    def loop(self, t: int, h: torch.Tensor, cos, sin, kv: KVAddressing, rows):
        m, eps = self.model, self.model.cfg.rms_norm_eps
        layers = m.layers
        x = rows("rms_norm", h, layers[0].ln, eps)
        cos, sin = cos[0], sin[0]  # [N, d]
        for li, w in enumerate(layers):
            a = self.attention(t, li, x, cos, sin, kv, rows)
            x, h = self.add_rms_norm(rows("rms_norm", a, w.ln_2, eps), h, w.post_ln, eps)
            mlp = rows("down_proj", rows("silu_mul", rows("gate_up_proj", x, w.gate_up)), w.down)
            after = layers[li + 1].ln if li + 1 < len(layers) else m.norm
            x, h = self.add_rms_norm(rows("rms_norm", mlp, w.post_ln_2, eps), h, after, eps)
        return x

    def attention(self, t: int, li: int, x, cos, sin, kv: KVAddressing, rows):
        m = self.model
        cfg, w, n = m.cfg, m.layers[li], x.shape[0]
        d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q, k, v = rows("qkv_proj", x, w.qkv).split((heads * d, kv_heads * d, kv_heads * d), -1)
        q, k = self.rotary(q.view(n, heads, d), k.view(n, kv_heads, d), cos, sin)
        plane, meta = kv.plane(t, li), kv.meta(t)
        m.backend.write_kv(m.kv, plane, k, v.view(n, kv_heads, d), meta)
        o = m.backend.forward(q.transpose(0, 1)[None], plane, m.kv, meta, m.scaling)
        return rows("o_proj", o, w.o)
