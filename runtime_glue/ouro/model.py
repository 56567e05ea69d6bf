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
the plan names for its rows' kind (``runtime_glue.ouro.loop_kernels``: in ``--mode fast`` a
residual add and the norm after it are one fused kernel, and so is the rotary embedding; every
other plan composes them from its own kernels, with HF's bits). Shapes and rounding follow
Hugging Face's Llama modules so that, per request, the tensors handed to every kernel match
HF's ([1, heads, S, d] for attention).

:meth:`OuroModel.forward` is the one function that runs a step's loops; every way a row runs
is data of the step (``runtime_glue.ouro.records``): the loops it runs (:class:`Span`: a plain
step is one span of every row through every loop; a speculative draft stops after loop E - 1,
a verify row starts at loop E from the state its draft kept, :class:`Kept`), where its K/V
lives at each (loop, layer) plane (``hal.types.KVAddressing``), which loop its logits come
from (``runtime_glue.ouro.exits.ExitRule``), and, under adaptive depth, when it leaves
(``runtime_glue.ouro.adaptive``). Eager steps and captured step graphs both call it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import torch
import torch.nn.functional as F

from hal.graphs import StaticDecodeMetadata, context_bucket
from hal.interfaces import Driver, KVStore
from hal.types import KVAddressing
from runtime_glue.ouro.adaptive import Adaptive
from runtime_glue.ouro.bound_loop import bound_loop
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import exit_pdf
from runtime_glue.ouro.loop_kernels import LoopKernels, RowOps
from runtime_glue.ouro.plan import ExecutionPlan
from runtime_glue.ouro.quantize import weight_bytes
from runtime_glue.ouro.records import DepthRows, Kept, Span, StepInputs, StepOutput

# recorder(loop, layer, op, tensor): sees intermediate tensors (used by the parity locator).
Recorder = Callable[[int, int, str, torch.Tensor], None]
ROPE_BLOCK = 1024  # positions per block of the cos/sin table


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
        plan: ExecutionPlan,
        driver: Driver,
        kv: KVStore,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.weight_bytes = weight_bytes(weights)  # as loaded: quantized ones packed
        self.backend = driver.backend(plan.attention)
        # Attention in the backend's deterministic form: the mode's guarantee, or in fast mode
        # where that form is the backend's fastest (AttentionBackend.deterministic_is_fastest).
        b = self.backend
        self.attend_deterministic = plan.deterministic or (
            plan.mode == "fast" and b.supports_deterministic and b.deterministic_is_fastest
        )
        self.kv = kv
        self.kernels = LoopKernels.from_plan(plan, driver)
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
        # Decode-sized calls with every kernel bound once, where the driver's kernels can be
        # (the per-op bits, less host work); None: every call per op.
        self.bound = bound_loop(self, driver)

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

    def _record(self, t: int, li: int, **values: torch.Tensor) -> None:
        if self.recorder is not None:
            for op, value in values.items():
                self.recorder(t, li, op, value)

    def attention(self, t: int, li: int, x, cos, sin, kv: KVAddressing, rows: RowOps):
        w, cfg, n = self.layers[li], self.cfg, x.shape[0]
        d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if self.kernels.stacked:
            q, k, v = rows("qkv_proj", x, w.qkv).split((heads * d, kv_heads * d, kv_heads * d), -1)
        else:
            q, k, v = (rows("qkv_proj", x, p) for p in (w.q, w.k, w.v))
        self._record(t, li, q_proj=q, k_proj=k, v_proj=v)  # [N, heads * d]
        q, k = rows.rotary(q.view(n, heads, d), k.view(n, kv_heads, d), cos, sin)  # [N, heads, d]
        plane, meta = kv.plane(t, li), kv.meta(t)
        self.backend.write_kv(self.kv, plane, k, v.view(n, kv_heads, d), meta)
        o = self.backend.forward(  # [N, Hq * d]
            q.transpose(0, 1)[None], plane, self.kv, meta, self.scaling,
            deterministic=self.attend_deterministic,
        )  # fmt: skip
        self._record(t, li, attention=o)
        return rows("o_proj", o, w.o)

    def mlp(self, li: int, x: torch.Tensor, rows: RowOps) -> torch.Tensor:
        w = self.layers[li]
        if self.kernels.stacked:
            act = rows("silu_mul", rows("gate_up_proj", x, w.gate_up))
        else:  # HF-exact: the activation on separate gate and up tensors, as HF calls it
            gate, up = rows("gate_up_proj", x, w.gate), rows("gate_up_proj", x, w.up)
            act = self.kernels.silu_mul(gate, up)
        return rows("down_proj", act, w.down)

    def loop(self, t: int, h, cos, sin, kv: KVAddressing, rows: RowOps) -> torch.Tensor:
        """Loop ``t``: every layer, then the final norm. Each residual add runs with the norm
        after it (``RowOps.add_rms_norm``): the layer's post-attention norm, the next layer's
        input norm or, after the last layer, the loop's final norm (the next loop's state)."""
        if self.bound is not None and self.bound.runs(h.shape[0], rows):
            return self.bound.loop(t, h, cos, sin, kv)
        eps, layers = self.cfg.rms_norm_eps, self.layers
        x = rows("rms_norm", h, layers[0].ln, eps)
        cos, sin = cos[0], sin[0]  # [N, d]
        for li, w in enumerate(layers):  # KV plane t * L + li
            a = self.attention(t, li, x, cos, sin, kv, rows)
            x, h = rows.add_rms_norm(rows("rms_norm", a, w.ln_2, eps), h, w.post_ln, eps)
            m = self.mlp(li, x, rows)
            after = layers[li + 1].ln if li + 1 < len(layers) else self.norm
            x, h = rows.add_rms_norm(rows("rms_norm", m, w.post_ln_2, eps), h, after, eps)
            self._record(t, li, mlp=m, residual=h)
        return x

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> StepOutput:
        """Every row through its loops, then the exit rule and the lm_head for the sampled
        rows: ``StepOutput`` (logits ``[R, vocab]`` bf16, exit loops, states, gates)."""
        T, R, N = self.cfg.total_ut_steps, step.sample_rows.shape[0], step.input_ids.shape[0]
        h = F.embedding(step.input_ids, self.embed)  # [N, H]
        cos, sin = self.rope(step.positions, step.max_position)
        kept, depth = step.kept, step.depth
        if depth is not None:  # depth rows past loop 0: from the state their last loop left
            h = self._depth_enter(h, depth)
        elif kept is not None:  # verify rows: from the states drafts kept
            h = h.index_copy(0, kept.rows, kept.states[:, -1])
        # Under depth-wise batching a row's exit is decided between steps (engine.core).
        adaptive = None
        if self.plan.adaptive_depth and depth is None:
            adaptive = Adaptive.start(self, step)
        hs: list[list] = [[] for _ in range(T)]  # per loop: (sampled rows, their states)
        gates: list[list] = [[] for _ in range(T)]
        every_row_gates = self._every_row_gates(step, adaptive)
        spans = self._as_run(step, adaptive)
        for span in spans:
            x, c, s = (h, cos, sin) if span.whole else self._enter(span, h, cos, sin)
            kv, rows = span.kv, self.kernels.bind(span.prompt_rows)
            for t in span.loops:
                if x.shape[0]:  # adaptive depth may have sent every row home
                    x = self.loop(t, x, c, s, kv, rows)
                if adaptive is not None and t < T - 1:
                    x, c, s, kv = adaptive.after_loop(t, x, c, s, kv)
                picked = self._picked(x, span, adaptive)
                hs[t].append((span.samples, picked))
                if step.exits.gated:
                    at = span.rows if every_row_gates else span.samples
                    gates[t].append((at, self._gate(x, picked, step, every_row_gates)))
            if depth is not None and span is spans[0]:
                kept = self._depth_pass(x, depth, step)
            if span is not spans[-1]:
                h = h.index_copy(0, span.rows, x)  # the next span continues from here
        if R == 0:  # depth rows only, none at its last loop: nothing is sampled
            return StepOutput(
                logits=h.new_empty(0, self.lm_head.shape[0]),
                chosen=step.sample_rows,
                states=h.new_empty(T, 0, h.shape[1]),
                gates=None,
            )
        states = torch.stack([self._assemble(p, R, kept, t, "states") for t, p in enumerate(hs)])
        gate_t = None
        if step.exits.gated:
            size = N if every_row_gates else R
            gate_t = torch.stack(
                [self._assemble(p, size, kept, t, "gates") for t, p in enumerate(gates)]
            )
        return self._exit(states, gate_t, step, adaptive)

    @staticmethod
    def _depth_enter(h: torch.Tensor, depth: DepthRows) -> torch.Tensor:
        """The step's state with each depth row past loop 0 replaced by its token's state
        after the loop before (read from the store; a row at loop 0 keeps its embedding)."""
        before = depth.states[depth.slots, (depth.loops - 1).clamp(min=0)]  # [D, H]
        mine = h.index_select(0, depth.rows)
        return h.index_copy(0, depth.rows, torch.where((depth.loops > 0)[:, None], before, mine))

    def _depth_pass(self, x, depth: DepthRows, step: StepInputs) -> Kept | None:
        """After the first span's pass: each depth row's state (and gate) after its loop into
        its token's slot, in place; then the sampled depth rows' loops so far (zeros after), for
        the exit rule. The gates by the generated rows' kernel, as plain decoding computes a
        sampled row's."""
        now = x.index_select(0, depth.rows)
        at = (depth.slots, depth.loops)
        depth.states.index_put_(at, now)
        if step.exits.gated:
            depth.gates.index_put_(at, self._gate_of(self.kernels.bind(0), now))
        if depth.kept_rows.shape[0] == 0:
            return None
        if depth.fills:
            self._depth_fill(depth, step.kv)
        loops = torch.arange(self.cfg.total_ut_steps, device=x.device)
        ran = loops[None, :] <= depth.kept_loops[:, None]  # [V, T]
        states = depth.states.index_select(0, depth.kept_slots)
        states = torch.where(ran[..., None], states, states.new_zeros(()))
        gates = None
        if step.exits.gated:
            gates = depth.gates.index_select(0, depth.kept_slots)
            gates = torch.where(ran, gates, gates.new_zeros(()))
        return Kept(rows=depth.kept_rows, samples=depth.kept_samples, states=states, gates=gates)

    def _depth_fill(self, depth: DepthRows, kv: KVAddressing) -> None:
        """The sampled depth rows' K/V at this loop into their slots of every later loop, at
        every layer: adaptive depth's fill (``fill_skipped_planes``) for a row that leaves
        after this loop, done in the step before anyone knows whether it leaves (so that a
        step graph holds it). A row that stays writes its next loop's K/V there before
        anything reads it (its request's next token waits for this one; no other request
        reads its generated pages); past the last loop a row writes its slot onto itself.
        Under kv sharing loop ``k``'s table is the row's loop + k's (``hal.shared_kv``): a
        generated block's slot is the same at every loop, a prompt block's is not."""
        T, L = self.cfg.total_ut_steps, self.cfg.num_hidden_layers
        rows, loops = depth.kept_rows, depth.kept_loops
        src = kv.write_slots(0).index_select(0, rows)  # this loop's slots
        later = [
            torch.where(loops + k < T, kv.write_slots(k).index_select(0, rows), src)
            for k in range(1, T)
        ]
        for li in range(L):
            key, value = self.kv.gather(li, src)  # [1, kv_heads, V, d]
            key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
            for dst in later:
                self.kv.write(li, key, value, dst)

    @staticmethod
    def _enter(span: Span, h, cos, sin):
        """The span's rows of the step's state and rotary tables."""
        return h.index_select(0, span.rows), cos[:, span.rows], sin[:, span.rows]

    def _as_run(self, step: StepInputs, adaptive: Adaptive | None) -> list[Span]:
        """The step's spans as their attention addresses K/V: as built, or in the static
        decode form where the plan runs decode-only steps so (``LoopKernels.static_decode``,
        the fast plan; without adaptive depth, which selects rows of the step as built): eager
        as in a step graph (``hal.graphs``), in the whole step's context bucket (every span's),
        so that a step's bits do not depend on whether it was replayed."""
        whole, spans = step.kv.base, list(step.spans)
        if not self.kernels.static_decode or adaptive is not None:
            return spans
        if isinstance(whole, StaticDecodeMetadata) or whole.num_tokens != whole.num_requests:
            return spans  # already static (a captured step), or not decode-only
        bs = whole.block_size
        width = context_bucket(max(-(-(c + 1) // bs) for c in whole.host_context_lens))
        form = partial(StaticDecodeMetadata.bucketed, width=width)
        return [
            attrs.evolve(span, kv=span.kv.map(form)) if span.kv.base.num_requests else span
            for span in spans
        ]

    def _assemble(self, parts, size: int, kept: Kept | None, t: int, what: str) -> torch.Tensor:
        """One loop's value for every sampled row (every row: HF-exact gates), from the spans
        that ran it and, for rows that start later, what their drafts kept (rows that stopped
        earlier: zeros, unread). Spans list their rows and samples ascending: one part of
        ``size`` values is the whole."""
        if len(parts) == 1 and parts[0][1].shape[0] == size:
            return parts[0][1]
        source = None if kept is None else kept.states if what == "states" else kept.gates
        if parts:
            like = parts[0][1]
        else:  # a loop only kept rows reach (depth rows at their last loop)
            assert source is not None
            like = source[:, 0]
        out = like.new_zeros((size, *like.shape[1:]))
        if kept is not None and source is not None and t < source.shape[1]:
            out = out.index_copy(0, kept.samples, source[:, t])
        for at, value in parts:
            out = out.index_copy(0, at, value)
        return out

    def _sampled_ops(self, step: StepInputs) -> RowOps:
        return self.kernels.bind(step.prompt_samples)

    def _every_row_gates(self, step: StepInputs, adaptive: Adaptive | None) -> bool:
        """Whether a step's gates are computed for every row, in the shapes HF computes them
        (all positions, ``F.linear`` with its bias): in HF-exact mode, for a one-span step
        without adaptive depth. Otherwise for the sampled rows, by the plan's kernel."""
        return not (
            self.plan.deterministic
            or adaptive is not None
            or len(step.spans) > 1
            or step.depth is not None
        )

    def _gate(self, x, picked, step: StepInputs, every_row: bool) -> torch.Tensor:
        """One loop's gate values: of every row ``[N]`` or of the sampled rows ``[R]``."""
        if every_row:
            return F.linear(x, self.gate_weight, self.gate_bias)[:, 0]  # [N]
        return self._gate_of(self._sampled_ops(step), picked)  # [R]

    def _gate_of(self, ops: RowOps, x: torch.Tensor) -> torch.Tensor:
        """The gate value of each row of ``x`` by the plan's kernel."""
        return (ops("exit_gate", x, self.gate_weight) + self.gate_bias)[:, 0]

    def _picked(self, x, span: Span, adaptive: Adaptive | None) -> torch.Tensor:
        """The state of the span's sampled rows after this loop."""
        if adaptive is not None:
            return adaptive.sampled(x)
        return x.index_select(0, span.sample_at)

    def _pdf(self, gates: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """The exit distribution of each sampled row ``[R, T]``."""
        if gates.shape[1] != len(step.host_sample_rows):  # all rows, as HF, then the sampled
            return exit_pdf(gates).index_select(0, step.sample_rows)
        # One row at a time: every call has the same shape, whatever the step holds.
        return torch.cat([exit_pdf(gates[:, r : r + 1]) for r in range(gates.shape[1])])

    def _exit(self, states, gates, step: StepInputs, adaptive: Adaptive | None) -> StepOutput:
        """The exit rule and the lm_head, in one place for every kind of step."""
        R = states.shape[1]
        pdf = self._pdf(gates, step) if gates is not None else None
        chosen = step.exits.loops(pdf)
        if adaptive is not None:
            chosen = adaptive.exit_steps(chosen)
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
        return StepOutput(logits=logits, chosen=chosen, states=states, gates=gates)
