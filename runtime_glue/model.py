"""The Ouro forward pass, written against the HAL and built from an execution plan.

    h = embed(ids)
    for t in 0..T-1:                       # loops share the L layers' weights
        for l in 0..L-1:                   # KV plane t * L + l
            h = h + ln2_l(attn_{t,l}(ln_l(h)))
            h = h + post_ln2_l(mlp_l(post_ln_l(h)))
        h = norm(h)                        # after every loop
    logits = lm_head(h)                    # last loop, sampled rows only

All tokens of a step (every request, prefill and decode alike) travel as one flat batch of N
rows, prompt positions first (``StepInputs.prompt_rows``). Every row-wise op runs the kernel
the plan names for its rows' kind (``runtime_glue.plan``). Shapes and rounding follow Hugging
Face's Llama modules so that, per request, the tensors handed to every kernel match HF's
([1, heads, S, d] for attention).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from hal.interfaces import Driver, KVStore
from hal.types import AttentionMetadata
from runtime_glue.config import OuroConfig
from runtime_glue.plan import KINDS, OPS, ExecutionPlan, hal_op, row_function

# recorder(loop, layer, op, tensor): sees intermediate tensors (used by the parity locator).
Recorder = Callable[[int, int, str, torch.Tensor], None]
ROPE_BLOCK = 1024  # positions per block of the cos/sin table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@attrs.frozen(eq=False)
class StepInputs:
    """One step's rows: every request's new tokens, prompt positions first."""

    input_ids: torch.Tensor  # [N] int64, on the device
    positions: torch.Tensor  # [N] int64, on the device
    attention: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: rows whose logits are wanted
    prompt_rows: int  # rows [0, prompt_rows) are prompt positions, the rest generated ones
    prompt_samples: int  # sample_rows[:prompt_samples] are prompt rows
    max_position: int  # the largest of positions (known on the host: no device read)


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


class RowOps:
    """The plan's kernels bound for one step's split of rows into prompt and generated."""

    def __init__(self, kernels: dict[str, dict[str, Callable]], split: int | None) -> None:
        self.kernels = kernels
        self.split = split  # None: both kinds run the same kernels

    def __call__(self, op: str, x: torch.Tensor, *consts) -> torch.Tensor:
        """``op`` on rows ``x`` (and constant arguments), each row by its kind's kernel."""
        p = self.split
        if p is None or p == x.shape[0]:
            return self.kernels["prompt"][op](x, *consts)
        if p == 0:
            return self.kernels["generated"][op](x, *consts)
        return torch.cat(
            (
                self.kernels["prompt"][op](x[:p], *consts),
                self.kernels["generated"][op](x[p:], *consts),
            )
        )


class OuroModel:
    """Ouro in fixed-loop mode (all T loops, logits of the last loop) over one KV store."""

    def __init__(
        self,
        cfg: OuroConfig,
        weights: dict[str, torch.Tensor],
        plan: ExecutionPlan,
        driver: Driver,
        kv: KVStore,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.backend = driver.backend(plan.attention)
        self.kv = kv
        self.kernels = {
            kind: {
                op: row_function(op, driver.kernel(hal_op(op), c.kernel), c.tiles)
                for op in OPS
                for c in (plan.choice(kind, op),)
            }
            for kind in KINDS
        }
        # HF-exact mode calls the activation on separate gate and up tensors, as HF does.
        self.silu_mul = driver.kernel("silu_mul", plan.choice("prompt", "silu_mul").kernel).fn
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
        self._cos = self._sin = torch.empty(1, 0, d, dtype=self.embed.dtype, device=device)
        self.scaling = d**-0.5
        self.recorder: Recorder | None = None

    def rope(self, positions: torch.Tensor, max_position: int):
        """cos, sin ``[1, N, d]``: angles in fp32, cast to bf16 last, as HF computes them.

        Read from a table computed a block of positions at a time, so a position's values
        never depend on which other positions share its step (within one call, an element's
        vectorised or scalar code path can).
        """
        while self._cos.shape[1] <= max_position:
            start = self._cos.shape[1]
            block = torch.arange(start, start + ROPE_BLOCK, device=self.inv_freq.device)
            freqs = block[None, :, None].float() * self.inv_freq  # [1, B, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = torch.cat((self._cos, emb.cos().to(self._cos.dtype)), dim=1)
            self._sin = torch.cat((self._sin, emb.sin().to(self._sin.dtype)), dim=1)
        return self._cos[:, positions], self._sin[:, positions]

    def attention(self, t: int, li: int, x, cos, sin, meta: AttentionMetadata, rows: RowOps):
        w, cfg, n = self.layers[li], self.cfg, x.shape[0]
        d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if self.plan.stacked:
            q, k, v = rows("qkv_proj", x, w.qkv).split((heads * d, kv_heads * d, kv_heads * d), -1)
        else:
            q, k, v = (rows("qkv_proj", x, p) for p in (w.q, w.k, w.v))
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
        o = self.backend.forward(  # [N, Hq * d]
            q, plane, self.kv, meta, self.scaling, deterministic=self.plan.deterministic
        )
        if self.recorder is not None:
            self.recorder(t, li, "attention", o)
        return rows("o_proj", o, w.o)

    def mlp(self, li: int, x: torch.Tensor, rows: RowOps) -> torch.Tensor:
        w = self.layers[li]
        if self.plan.stacked:
            act = rows("silu_mul", rows("gate_up_proj", x, w.gate_up))
        else:
            gate, up = rows("gate_up_proj", x, w.gate), rows("gate_up_proj", x, w.up)
            act = self.silu_mul(gate, up)
        return rows("down_proj", act, w.down)

    def layer(self, t: int, li: int, h, cos, sin, meta, rows: RowOps):
        w, eps = self.layers[li], self.cfg.rms_norm_eps
        a = self.attention(t, li, rows("rms_norm", h, w.ln, eps), cos, sin, meta, rows)
        h = h + rows("rms_norm", a, w.ln_2, eps)
        m = self.mlp(li, rows("rms_norm", h, w.post_ln, eps), rows)
        if self.recorder is not None:
            self.recorder(t, li, "mlp", m)
        h = h + rows("rms_norm", m, w.post_ln_2, eps)
        if self.recorder is not None:
            self.recorder(t, li, "residual", h)
        return h

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Returns the final loop's logits ``[R, vocab]`` (bf16) for ``step.sample_rows``."""
        split = self.plan.split
        rows = RowOps(self.kernels, step.prompt_rows if split else None)
        h = F.embedding(step.input_ids, self.embed)  # [N, H]
        cos, sin = self.rope(step.positions, step.max_position)
        eps = self.cfg.rms_norm_eps
        for t in range(self.cfg.total_ut_steps):
            for li in range(self.cfg.num_hidden_layers):
                h = self.layer(t, li, h, cos, sin, step.attention, rows)
            h = rows("rms_norm", h, self.norm, eps)
        sampled = RowOps(self.kernels, step.prompt_samples if split else None)
        return sampled("lm_head", h.index_select(0, step.sample_rows), self.lm_head)  # [R, V]
