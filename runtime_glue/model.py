"""The Ouro forward pass, written against the HAL.

    h = embed(ids)
    for t in 0..T-1:                       # loops share the L layers' weights
        for l in 0..L-1:                   # KV plane t * L + l
            h = h + ln2_l(attn_{t,l}(ln_l(h)))
            h = h + post_ln2_l(mlp_l(post_ln_l(h)))
        h = norm(h)                        # after every loop
    logits = lm_head(h)                    # last loop, sampled rows only

All tokens of a step (every request, prefill and decode alike) travel as one flat batch of N
rows. Shapes and rounding follow Hugging Face's Llama modules so that, per request, the
tensors handed to every kernel match HF's ([1, heads, S, d] for attention).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from hal.interfaces import AttentionBackend, KVStore
from hal.types import AttentionMetadata
from runtime_glue.config import OuroConfig

# recorder(loop, layer, op, tensor): sees intermediate tensors (used by the parity locator).
Recorder = Callable[[int, int, str, torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: statistics in fp32, cast back, then ``weight * x`` in bf16."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@attrs.frozen
class LayerWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qkv: torch.Tensor  # q | k | v stacked (views of the same memory, see checkpoint.STACKED)
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    gate_up: torch.Tensor  # gate | up stacked
    down: torch.Tensor
    ln: torch.Tensor
    ln_2: torch.Tensor
    post_ln: torch.Tensor
    post_ln_2: torch.Tensor

    @classmethod
    def from_checkpoint(cls, weights: dict[str, torch.Tensor], layer: int) -> LayerWeights:
        p = f"model.layers.{layer}."
        return cls(
            q=weights[p + "self_attn.q_proj.weight"],
            k=weights[p + "self_attn.k_proj.weight"],
            v=weights[p + "self_attn.v_proj.weight"],
            qkv=weights[p + "self_attn.qkv_proj.weight"],
            o=weights[p + "self_attn.o_proj.weight"],
            gate=weights[p + "mlp.gate_proj.weight"],
            up=weights[p + "mlp.up_proj.weight"],
            gate_up=weights[p + "mlp.gate_up_proj.weight"],
            down=weights[p + "mlp.down_proj.weight"],
            ln=weights[p + "input_layernorm.weight"],
            ln_2=weights[p + "input_layernorm_2.weight"],
            post_ln=weights[p + "post_attention_layernorm.weight"],
            post_ln_2=weights[p + "post_attention_layernorm_2.weight"],
        )


class OuroModel:
    """Ouro in fixed-loop mode (all T loops, logits of the last loop) over one KV store."""

    def __init__(
        self,
        cfg: OuroConfig,
        weights: dict[str, torch.Tensor],
        backend: AttentionBackend,
        kv: KVStore,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.kv = kv
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = weights["lm_head.weight"]
        # Loaded and validated, unused in fixed-loop mode (adaptive exit is out of scope).
        self.early_exit_gate = (
            weights["model.early_exit_gate.weight"],
            weights["model.early_exit_gate.bias"],
        )
        self.layers = [
            LayerWeights.from_checkpoint(weights, i) for i in range(cfg.num_hidden_layers)
        ]
        d = cfg.head_dim
        device = self.embed.device
        # fp32 on purpose: a bf16 inv_freq would silently change every logit.
        self.inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
        )
        self.scaling = d**-0.5
        self.recorder: Recorder | None = None
        self.deterministic = False
        # F.linear, or a driver's kernel (LLM(linear=...)), or its row-invariant form.
        self.linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
        # One call on q|k|v and on gate|up instead of one per projection: only for kernels
        # that give the same bits either way (Driver.column_invariant_linears).
        self.stacked = False
        # HF's RMSNorm, or in deterministic mode a driver's row-invariant kernel.
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm

    def enable_deterministic(self, allow_padding: bool = True, norm=None) -> None:
        """Row-invariant execution (see runtime_glue.determinism); verified before enabling.

        ``allow_padding=False`` refuses the padded linear (it doubles one-row decode calls).
        ``norm``: a driver's RMSNorm kernel to run instead of HF's torch operations.
        """
        from runtime_glue.determinism import choose_linear

        if not self.backend.supports_deterministic:
            raise ValueError(
                f"attention backend {self.backend.name!r} does not support deterministic mode"
            )
        w = self.layers[0]
        eps, norm_w, norm = self.cfg.rms_norm_eps, w.ln, norm or rms_norm
        stacked = [w.qkv, w.gate_up] if self.stacked else []
        self.linear = choose_linear(
            [w.q, w.k, w.v, w.o, w.gate, w.up, w.down, self.lm_head, *stacked],
            lambda x: norm(x, norm_w, eps),
            allow_padding,
            base=self.linear,
        )
        self.rms_norm = norm
        self.deterministic = True

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, N, d]``: angles in fp32, cast to bf16 last."""
        freqs = positions[None, :, None].float() * self.inv_freq  # [1, N, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def attention(self, t: int, li: int, x, cos, sin, meta: AttentionMetadata):
        w, cfg, n = self.layers[li], self.cfg, x.shape[0]
        d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if self.stacked:
            q, k, v = self.linear(x, w.qkv).split((heads * d, kv_heads * d, kv_heads * d), -1)
        else:
            q, k, v = (self.linear(x, p) for p in (w.q, w.k, w.v))
        q = q.view(1, n, heads, d).transpose(1, 2)
        k = k.view(1, n, kv_heads, d).transpose(1, 2)
        v = v.view(1, n, kv_heads, d).transpose(1, 2)
        if self.recorder is not None:
            for op, val in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                self.recorder(t, li, op, val.transpose(1, 2).reshape(n, -1))
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, N, d]
        q = q * cos + rotate_half(q) * sin  # [1, Hq, N, d]
        k = k * cos + rotate_half(k) * sin  # [1, Hkv, N, d]
        plane = t * cfg.num_hidden_layers + li
        self.kv.write(plane, k[0].transpose(0, 1), v[0].transpose(0, 1), meta.slot_mapping)
        o = self.backend.forward(q, plane, self.kv, meta, self.scaling)  # [N, Hq * d]
        if self.recorder is not None:
            self.recorder(t, li, "attention", o)
        return self.linear(o, w.o)

    def mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        w = self.layers[li]
        lin = self.linear
        if self.stacked:
            gate, up = lin(x, w.gate_up).chunk(2, dim=-1)
        else:
            gate, up = lin(x, w.gate), lin(x, w.up)
        return lin(F.silu(gate) * up, w.down)

    def layer(self, t: int, li: int, h, cos, sin, meta):
        w, eps, norm = self.layers[li], self.cfg.rms_norm_eps, self.rms_norm
        a = self.attention(t, li, norm(h, w.ln, eps), cos, sin, meta)
        h = h + norm(a, w.ln_2, eps)
        m = self.mlp(li, norm(h, w.post_ln, eps))
        if self.recorder is not None:
            self.recorder(t, li, "mlp", m)
        h = h + norm(m, w.post_ln_2, eps)
        if self.recorder is not None:
            self.recorder(t, li, "residual", h)
        return h

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,  # [R] int64: rows whose logits are wanted
    ) -> torch.Tensor:
        """Returns the final loop's logits ``[R, vocab]`` (bf16) for ``sample_rows``."""
        h = F.embedding(input_ids, self.embed)  # [N, H]
        cos, sin = self.rope(positions)
        for t in range(self.cfg.total_ut_steps):
            for li in range(self.cfg.num_hidden_layers):
                h = self.layer(t, li, h, cos, sin, meta)
            h = self.rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        return self.linear(h.index_select(0, sample_rows), self.lm_head)  # [R, vocab]
