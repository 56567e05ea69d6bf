"""The Ouro forward pass, written against the HAL and built from an execution plan.

    h = embed(ids)
    for t in 0..T-1:                       # loops share the L layers' weights
        for l in 0..L-1:                   # KV plane t * L + l
            h = h + ln2_l(attn_{t,l}(ln_l(h)))
            h = h + post_ln2_l(mlp_l(post_ln_l(h)))
        h = norm(h)                        # after every loop
    logits = lm_head(h_exit)               # the exit rule's loop, sampled rows only

All tokens of a step (every request, prefill and decode alike) travel as one flat batch of N
rows, prompt positions first (``StepInputs.prompt_rows``). Every row-wise op runs the kernel
the plan names for its rows' kind (``runtime_glue.ouro.plan``). Shapes and rounding follow Hugging
Face's Llama modules so that, per request, the tensors handed to every kernel match HF's
([1, heads, S, d] for attention).

:meth:`OuroModel.forward` is the one function that runs a step's loops; every way a row runs
is data of the step: the loops it runs (:class:`Span`: a speculative draft stops after loop
E - 1, a verify row starts at loop E from the state its draft kept, :class:`Kept`), where its
K/V lives at each (loop, layer) plane (``hal.types.KVAddressing``), which loop its logits come
from (``runtime_glue.ouro.exits.ExitRule``), and, under adaptive depth, when it leaves
(``runtime_glue.ouro.adaptive``). Eager steps and captured step graphs both call it.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from hal.graphs import StaticDecodeMetadata, context_bucket
from hal.interfaces import Driver, KVStore
from hal.types import KVAddressing
from runtime_glue.ouro.adaptive import Adaptive
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import ExitRule, exit_pdf
from runtime_glue.ouro.fused import FusedLoop
from runtime_glue.ouro.plan import KINDS, OPS, ExecutionPlan, hal_op, row_function

# recorder(loop, layer, op, tensor): sees intermediate tensors (used by the parity locator).
Recorder = Callable[[int, int, str, torch.Tensor], None]
ROPE_BLOCK = 1024  # positions per block of the cos/sin table


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@attrs.frozen(eq=False)
class Span:
    """Rows of a step that run ``loops`` together. A step without spans runs every row
    through every loop; speculative steps have two (``runtime_glue.engine.speculative``)."""

    loops: range
    rows: torch.Tensor  # [n] int64: the step's rows in this span, in order
    kv: KVAddressing  # of those rows
    samples: torch.Tensor  # [m] int64: which sampled rows are among them ...
    sample_at: torch.Tensor  # [m] int64: ... and where within the span
    prompt_rows: int  # the span's first rows that are prompt positions


@attrs.frozen(eq=False)
class Kept:
    """Rows that start after loop 0, from the states an earlier step kept (verify rows)."""

    rows: torch.Tensor  # [V] int64: their rows in the step
    samples: torch.Tensor  # [V] int64: their sampled-row indices
    states: torch.Tensor  # [V, E, H]: the state after each of loops 0 .. E-1
    gates: torch.Tensor | None  # [V, E]: the gate after each, when the step is gated


@attrs.frozen(eq=False)
class StepInputs:
    """One step's rows: every request's new tokens, prompt positions first."""

    input_ids: torch.Tensor  # [N] int64, on the device
    positions: torch.Tensor  # [N] int64, on the device
    kv: KVAddressing  # where each row's K/V lives at every (loop, layer) plane
    sample_rows: torch.Tensor  # [R] int64: rows whose logits are wanted
    prompt_rows: int  # rows [0, prompt_rows) are prompt positions, the rest generated ones
    prompt_samples: int  # sample_rows[:prompt_samples] are prompt rows
    max_position: int  # the largest of positions (known on the host: no device read)
    exits: ExitRule  # per sampled row
    host_sample_rows: tuple[int, ...]  # sample_rows, on the host
    spans: tuple[Span, ...] = ()  # (): one span, every row through every loop
    kept: Kept | None = None
    modes: tuple = ()  # per sampled row, ExitMode (adaptive depth reads the thresholds)


@attrs.frozen(eq=False)
class StepOutput:
    """What a step computed for its sampled rows, on the device."""

    logits: torch.Tensor  # [R, vocab]: the chosen loop's logits
    chosen: torch.Tensor  # [R] int64: the loop each row's logits came from
    states: torch.Tensor  # [T, R, H]: each sampled row's state after every loop
    gates: torch.Tensor | None  # [T, R]: its gate after every loop, when gated


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
        self.gate_weight = weights["model.early_exit_gate.weight"]  # [1, H]
        self.gate_bias = weights["model.early_exit_gate.bias"]  # [1]
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
        self.fused = FusedLoop(self, plan, driver) if plan.fused else None  # --mode fast

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

    def attention(self, t: int, li: int, x, cos, sin, kv: KVAddressing, rows: RowOps):
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
        plane, meta = kv.plane(t, li), kv.meta(t)
        self.backend.write_kv(self.kv, plane, k[0].transpose(0, 1), v[0].transpose(0, 1), meta)
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

    def layer(self, t: int, li: int, h, cos, sin, kv: KVAddressing, rows: RowOps):
        w, eps = self.layers[li], self.cfg.rms_norm_eps
        a = self.attention(t, li, rows("rms_norm", h, w.ln, eps), cos, sin, kv, rows)
        h = h + rows("rms_norm", a, w.ln_2, eps)
        m = self.mlp(li, rows("rms_norm", h, w.post_ln, eps), rows)
        if self.recorder is not None:
            self.recorder(t, li, "mlp", m)
        h = h + rows("rms_norm", m, w.post_ln_2, eps)
        if self.recorder is not None:
            self.recorder(t, li, "residual", h)
        return h

    def loop(self, t: int, h, cos, sin, kv: KVAddressing, rows: RowOps) -> torch.Tensor:
        """Loop ``t``: every layer, then the final norm (the fused loop in ``--mode fast``)."""
        if self.fused is not None:
            return self.fused.loop(t, h, cos, sin, kv, rows)
        for li in range(self.cfg.num_hidden_layers):
            h = self.layer(t, li, h, cos, sin, kv, rows)
        return rows("rms_norm", h, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> StepOutput:
        """Every row through its loops, then the exit rule and the lm_head for the sampled
        rows: ``StepOutput`` (logits ``[R, vocab]`` bf16, exit loops, states, gates)."""
        T, R = self.cfg.total_ut_steps, step.sample_rows.shape[0]
        h = F.embedding(step.input_ids, self.embed)  # [N, H]
        cos, sin = self.rope(step.positions, step.max_position)
        kept = step.kept
        if kept is not None:  # verify rows start from the state their drafts kept
            h = h.index_copy(0, kept.rows, kept.states[:, -1])
        hs: list[list] = [[] for _ in range(T)]  # per loop: (sampled rows, their states)
        gates: list[list] = [[] for _ in range(T)]
        early = Adaptive.start(self, step) if self.plan.adaptive_depth else None
        spans = step.spans or (None,)
        for span in spans:
            x, c, s = (h, cos, sin) if span is None else self._enter(span, h, cos, sin)
            kv = self._decode_form(step.kv if span is None else span.kv, step.kv, early)
            split = step.prompt_rows if span is None else span.prompt_rows
            ops = RowOps(self.kernels, split if self.plan.split else None)
            for t in range(T) if span is None else span.loops:
                if x.shape[0]:  # adaptive depth may have sent every row home
                    x = self.loop(t, x, c, s, kv, ops)
                if early is not None and t < T - 1:
                    x, c, s, kv = early.after_loop(t, x, c, s, kv)
                at = None if span is None else span.samples
                picked = self._picked(x, step, span, early)
                hs[t].append((at, picked))
                if step.exits.gated:
                    gates[t].append((at, self._gate(x, picked, step, span, early)))
            if span is not None and len(spans) > 1:
                h = h.index_copy(0, span.rows, x)  # the next span continues from here
        states = torch.stack(
            [self._assemble(parts, R, kept, t, "states") for t, parts in enumerate(hs)]
        )
        gate_t = None
        if step.exits.gated:
            gate_t = torch.stack(
                [self._assemble(parts, R, kept, t, "gates") for t, parts in enumerate(gates)]
            )
        return self._exit(states, gate_t, step, early)

    def _enter(self, span: Span, h, cos, sin):
        return h.index_select(0, span.rows), cos[:, span.rows], sin[:, span.rows]

    def _decode_form(self, kv: KVAddressing, whole: KVAddressing, early) -> KVAddressing:
        """The fast plan runs a decode-only step in its static decode form, eager as in a step
        graph (``hal.graphs``), in the whole step's context bucket (every span's): its bits do
        not depend on whether the step was replayed."""
        base, step = kv.base, whole.base
        if self.fused is None or early is not None or isinstance(base, StaticDecodeMetadata):
            return kv
        if not base.num_requests or step.num_tokens != step.num_requests:
            return kv
        bs = step.block_size
        width = context_bucket(max(-(-(c + 1) // bs) for c in step.host_context_lens))
        return kv.map(lambda meta: StaticDecodeMetadata.bucketed(meta, width))

    def _picked(self, x, step: StepInputs, span: Span | None, early) -> torch.Tensor:
        """The state of the span's sampled rows after this loop."""
        if early is not None:
            return early.sampled(x)
        return x.index_select(0, step.sample_rows if span is None else span.sample_at)

    def _assemble(self, parts, R: int, kept: Kept | None, t: int, what: str) -> torch.Tensor:
        """One loop's value for every sampled row, from the spans that ran it and, for rows
        that start later, what their drafts kept (rows that stopped earlier: zeros, unread)."""
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        like = parts[0][1]
        out = like.new_zeros((R, *like.shape[1:]))
        if kept is not None:
            source = kept.states if what == "states" else kept.gates
            if source is not None and t < source.shape[1]:
                out = out.index_copy(0, kept.samples, source[:, t])
        for at, value in parts:
            out = out.index_copy(0, at, value)
        return out

    def _sampled_ops(self, step: StepInputs) -> RowOps:
        return RowOps(self.kernels, step.prompt_samples if self.plan.split else None)

    def _gate(self, x, picked, step: StepInputs, span, early) -> torch.Tensor:
        """One loop's gate values: of every row of the step in HF-exact mode (the shapes HF
        computes them in: all positions, ``F.linear`` with its bias), of the sampled rows
        through the plan's kernel in deterministic mode, with adaptive depth or spans."""
        if self.plan.deterministic or early is not None or span is not None:
            g = self._sampled_ops(step)("exit_gate", picked, self.gate_weight)
            return (g + self.gate_bias)[:, 0]  # [R]
        return F.linear(x, self.gate_weight, self.gate_bias)[:, 0]  # [N]

    def _pdf(self, gates: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """The exit distribution of each sampled row ``[R, T]``."""
        if gates.shape[1] != len(step.host_sample_rows):  # all rows, as HF, then the sampled
            return exit_pdf(gates).index_select(0, step.sample_rows)
        # One row at a time: every call has the same shape, whatever the step holds.
        return torch.cat([exit_pdf(gates[:, r : r + 1]) for r in range(gates.shape[1])])

    def _exit(self, states, gates, step: StepInputs, early) -> StepOutput:
        """The exit rule and the lm_head, in one place for every kind of step."""
        R = states.shape[1]
        pdf = self._pdf(gates, step) if gates is not None else None
        chosen = step.exits.loops(pdf)
        if early is not None:
            chosen = early.exit_steps(chosen)
        selected = states[chosen, torch.arange(R, device=states.device)]  # [R, H]
        logits = self._sampled_ops(step)("lm_head", selected, self.lm_head)  # [R, V]
        weighted = step.exits.weighted
        if weighted:
            assert pdf is not None
            idx = torch.tensor(weighted, device=states.device)
            ops = RowOps(self.kernels, sum(r < step.prompt_samples for r in weighted))
            expected: torch.Tensor | None = None
            for t in range(states.shape[0]):
                step_logits = ops("lm_head", states[t].index_select(0, idx), self.lm_head)
                weight = pdf.index_select(0, idx)[:, t : t + 1].to(step_logits.dtype)
                term = step_logits * weight
                expected = term if expected is None else expected + term
            assert expected is not None
            logits.index_copy_(0, idx, expected)
        if gates is not None and gates.shape[1] != R:  # HF-exact: every row's; keep the sampled
            gates = gates.index_select(1, step.sample_rows)
        return StepOutput(logits, chosen, states, gates)
