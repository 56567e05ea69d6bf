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
the plan names for its rows' kind (``runtime_glue.ouro.plan``). Shapes and rounding follow Hugging
Face's Llama modules so that, per request, the tensors handed to every kernel match HF's
([1, heads, S, d] for attention).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from hal.graphs import StaticDecodeMetadata
from hal.interfaces import Driver, KVStore
from hal.shared_kv import select_metadata, write_kv
from hal.types import AttentionMetadata
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import ExitMode, exit_pdf, threshold_steps
from runtime_glue.ouro.fused import FusedLoop
from runtime_glue.ouro.plan import KINDS, OPS, ExecutionPlan, hal_op, row_function

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
    exit_modes: tuple[ExitMode, ...] = ()  # per sampled row; () means the last loop for all
    host_sample_rows: tuple[int, ...] = ()  # sample_rows, on the host


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
        write_kv(self.kv, plane, k[0].transpose(0, 1), v[0].transpose(0, 1), meta)
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
    def loop(self, t: int, h, cos, sin, meta, rows: RowOps) -> torch.Tensor:
        """Loop ``t``: every layer, then the final norm (the fused loop in ``--mode fast``).
        Eager steps and captured step graphs both run a loop through here."""
        if self.fused is not None:
            return self.fused.loop(t, h, cos, sin, meta, rows)
        for li in range(self.cfg.num_hidden_layers):
            h = self.layer(t, li, h, cos, sin, meta, rows)
        return rows("rms_norm", h, self.norm, self.cfg.rms_norm_eps)

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen loops' logits ``[R, vocab]`` (bf16) for ``step.sample_rows``, and the loop
        each row's logits came from (``[R]`` int64), both on the device."""
        split = self.plan.split
        rows = RowOps(self.kernels, step.prompt_rows if split else None)
        h = F.embedding(step.input_ids, self.embed)  # [N, H]
        cos, sin = self.rope(step.positions, step.max_position)
        T = self.cfg.total_ut_steps
        modes = step.exit_modes or (ExitMode(),) * step.sample_rows.shape[0]
        gated = any(m.kind in ("threshold", "weighted") for m in modes)
        early = Adaptive.start(self, step, modes) if self.plan.adaptive_depth else None
        hs: list[torch.Tensor] = []  # h_t of the sampled rows, per loop
        gates: list[torch.Tensor] = []
        meta: AttentionMetadata | StaticDecodeMetadata = step.attention
        eager = step.attention
        if self.fused is not None and early is None and eager.num_tokens == eager.num_requests:
            # The fast plan's decode form, eager as in a step graph (hal.graphs): its bits
            # do not depend on whether the step was replayed.
            meta = StaticDecodeMetadata.bucketed(eager)
        for t in range(T):
            if h.shape[0]:  # adaptive depth may have sent every row home
                h = self.loop(t, h, cos, sin, meta, rows)
            if early is not None and t < T - 1:
                h, cos, sin, meta = early.after_loop(t, h, cos, sin, meta)
            sampled_h = (
                early.sampled(h) if early is not None else h.index_select(0, step.sample_rows)
            )
            hs.append(sampled_h)
            if gated:
                gates.append(self._gate(h, sampled_h, step, per_row=early is not None))
        return self._exit_logits(hs, gates, step, modes, early)

    def _sampled_ops(self, step: StepInputs) -> RowOps:
        return RowOps(self.kernels, step.prompt_samples if self.plan.split else None)

    def _gate(self, h, sampled_h, step: StepInputs, per_row: bool = False) -> torch.Tensor:
        """One loop's gate values: of every row of the step in HF-exact mode (the shapes HF
        computes them in: all positions, ``F.linear`` with its bias), of the sampled rows
        through the plan's kernel in deterministic mode or with adaptive depth."""
        if self.plan.deterministic or per_row:
            g = self._sampled_ops(step)("exit_gate", sampled_h, self.gate_weight)
            return (g + self.gate_bias)[:, 0]  # [R]
        return F.linear(h, self.gate_weight, self.gate_bias)[:, 0]  # [N]

    def _pdf(self, gates: list[torch.Tensor], step: StepInputs) -> torch.Tensor:
        """The exit distribution of each sampled row ``[R, T]``."""
        stacked = torch.stack(gates)  # [T, N] or [T, R]
        if stacked.shape[1] != len(step.host_sample_rows):  # all rows, as HF, then the sampled
            return exit_pdf(stacked).index_select(0, step.sample_rows)
        # One row at a time: every call has the same shape, whatever the step holds.
        return torch.cat([exit_pdf(stacked[:, r : r + 1]) for r in range(stacked.shape[1])])

    def _exit_logits(self, hs, gates, step: StepInputs, modes, early):
        T, R = len(hs), len(modes)
        device = hs[0].device
        # Fixed loops known on the host, copied once (not a device write per row).
        fixed = [m.step if m.step is not None else T - 1 for m in modes]
        chosen = torch.tensor(fixed, dtype=torch.int64, device=device)
        pdf = self._pdf(gates, step) if gates else None
        for q in {m.threshold for m in modes if m.kind == "threshold"}:
            rows_q = [r for r, m in enumerate(modes) if m.kind == "threshold" and m.threshold == q]
            picked = torch.tensor(rows_q, device=device)
            assert pdf is not None
            chosen.index_copy_(0, picked, threshold_steps(pdf.index_select(0, picked), q))
        if early is not None:
            chosen = early.exit_steps(chosen)
        stacked = torch.stack(hs)  # [T, R, H]
        selected = stacked[chosen, torch.arange(R, device=device)]  # [R, H]
        logits = self._sampled_ops(step)("lm_head", selected, self.lm_head)  # [R, V]
        weighted = [r for r, m in enumerate(modes) if m.kind == "weighted"]
        if weighted:
            assert pdf is not None
            idx = torch.tensor(weighted, device=device)
            ops = RowOps(self.kernels, sum(r < step.prompt_samples for r in weighted))
            expected: torch.Tensor | None = None
            for t in range(T):
                step_logits = ops("lm_head", stacked[t].index_select(0, idx), self.lm_head)
                weight = pdf.index_select(0, idx)[:, t : t + 1].to(step_logits.dtype)
                term = step_logits * weight
                expected = term if expected is None else expected + term
            assert expected is not None
            logits.index_copy_(0, idx, expected)
        return logits, chosen


class Adaptive:
    """Adaptive depth, for one step: a decode row whose cumulative exit probability reaches its
    threshold after loop ``t`` leaves the batch, and its later loops are not run.

    The planes of the loops it skipped still need its K/V, which later tokens attend to: they
    get the K/V of its last computed loop at the same layer (plane ``t * L + l`` copied to
    ``t' * L + l`` for every skipped ``t'``). This approximates the checkpoint's own arithmetic,
    which runs every loop (docs/benchmarks.md measures how often tokens still agree). Deciding
    who leaves reads the exit test back from the device once per loop.
    """

    def __init__(self, model: OuroModel, step: StepInputs, exits: dict[int, float]) -> None:
        self.model, self.step, self.exits = model, step, exits
        self.batch = list(range(step.input_ids.shape[0]))  # original row of each batch row
        self.remaining: dict[int, torch.Tensor | None] = dict.fromkeys(exits)  # prod (1 - lambda)
        self.cumulative: dict[int, torch.Tensor] = {}
        self.exited: dict[int, tuple[int, torch.Tensor]] = {}  # sampled row -> (loop, h_t)

    @classmethod
    def start(cls, model: OuroModel, step: StepInputs, modes) -> Adaptive | None:
        """Only decode rows (one row of a generated position, sampled) in threshold mode."""
        meta = step.attention
        one_row = {meta.request(q)[0] for q in range(meta.num_requests) if meta.request(q)[1] == 1}
        exits = {
            r: m.threshold
            for r, m in enumerate(modes)
            if m.kind == "threshold"
            and r >= step.prompt_samples
            and step.host_sample_rows[r] in one_row
        }
        return cls(model, step, exits) if exits else None

    def after_loop(self, t: int, h, cos, sin, meta):
        """Test the rows still in the batch after loop ``t``; drop those that exit."""
        leaving = [r for r in self._still_in() if self._reached(r, t, h)]
        if not leaving:
            return h, cos, sin, meta
        for r in leaving:
            position = self.batch.index(self.step.host_sample_rows[r])
            self.exited[r] = (t, h[position : position + 1])
            if meta.shared is None:  # under kv sharing its shared planes hold loop t's K/V
                self._fill_skipped_planes(t, meta, position)
        gone = {self.step.host_sample_rows[r] for r in leaving}
        keep = [i for i, row in enumerate(self.batch) if row not in gone]
        starts = meta.host_query_start_loc
        requests = [q for q in range(meta.num_requests) if self.batch[starts[q]] not in gone]
        self.batch = [self.batch[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.int64, device=h.device)
        return (
            h.index_select(0, index),
            cos[:, index],
            sin[:, index],
            select_metadata(meta, requests),
        )

    def _still_in(self) -> list[int]:
        return [r for r in self.exits if r not in self.exited]

    def _reached(self, r: int, t: int, h: torch.Tensor) -> bool:
        position = self.batch.index(self.step.host_sample_rows[r])
        gate_fn = self.model.kernels["generated"]["exit_gate"]
        g = gate_fn(h[position : position + 1], self.model.gate_weight) + self.model.gate_bias
        lam = torch.sigmoid(g[0])  # [1], the same shape for every row
        remaining = self.remaining[r]
        p = lam if remaining is None else lam * remaining
        self.remaining[r] = (1.0 - lam) if remaining is None else remaining * (1.0 - lam)
        self.cumulative[r] = p if r not in self.cumulative else self.cumulative[r] + p
        return bool(self.cumulative[r] >= self.exits[r])  # a read of the device, per loop

    def _fill_skipped_planes(self, t: int, meta, position: int) -> None:
        model, L = self.model, self.model.cfg.num_hidden_layers
        slot = meta.slot_mapping[position : position + 1]
        for li in range(L):
            k, v = model.kv.gather(t * L + li, slot)  # [1, kv_heads, 1, d]
            for later in range(t + 1, model.cfg.total_ut_steps):
                model.kv.write(later * L + li, k[0].transpose(0, 1), v[0].transpose(0, 1), slot)

    def sampled(self, h: torch.Tensor) -> torch.Tensor:
        """This loop's state of each sampled row: an exited row keeps the state it exited with."""
        parts = []
        for r, row in enumerate(self.step.host_sample_rows):
            if r in self.exited:
                parts.append(self.exited[r][1])
            else:
                position = self.batch.index(row)
                parts.append(h[position : position + 1])
        return torch.cat(parts)

    def exit_steps(self, chosen: torch.Tensor) -> torch.Tensor:
        for r, (t, _) in self.exited.items():
            chosen[r] = t
        return chosen
