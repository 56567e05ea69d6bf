"""Rows over a range of Ouro's loops, from a given hidden state: the model side of
self-speculative decoding (``runtime_glue.engine.speculative``).

A step that drafts or verifies holds three groups of rows, in this order:

    normal  [0, A)         loops 0 .. T-1 from their embeddings (prompt rows first)
    draft   [A, A+D)       loops 0 .. E-1 from their embeddings (one generated row each)
    verify  [A+D, A+D+V)   loops E .. T-1 from the states after loop E-1 that their own
                           draft steps kept

Loops < E run over the normal and draft rows, loops >= E over the normal and verify rows, each
loop with the attention metadata of its own requests only: a draft row writes the K/V of
planes ``t * L + l`` with t < E, a verify row those with t >= E, at the same slots. In
deterministic mode a row's bits do not depend on the rows it shares a step with
(docs/determinism.md), so a verify row computes at every loop exactly what plain one-token
decoding of the same position and token computes. The exit rule (``runtime_glue.ouro.exits``)
of a verify row sees all T loops' states and gates: those of loops < E come from its draft
step.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from hal.types import AttentionMetadata
from runtime_glue.ouro.model import OuroModel, RowOps, StepInputs


@attrs.frozen(eq=False)
class LoopRows:
    """How a step's rows split into the three groups, and what the verify rows start from."""

    early: int  # E: draft rows run loops [0, E), verify rows [E, T)
    normal_requests: int  # the metadata's first requests are normal, then draft, then verify
    draft_requests: int
    normal_rows: int  # A
    draft_rows: int  # D (one per draft request)
    normal_samples: int  # sample_rows[:normal_samples] are normal rows
    draft_samples: tuple[int, ...]  # draft rows (0-based in the group) that want a draft token
    verify_states: torch.Tensor  # [V, E, H]: each verify row's state after loops 0 .. E-1
    verify_gates: torch.Tensor | None  # [V, E]: their gate values, when ``gated``
    gated: bool  # some request of the step exits by the gate (threshold or weighted)


@attrs.frozen(eq=False)
class LoopOutputs:
    logits: torch.Tensor  # [R, vocab]: normal samples, draft samples, then every verify row
    chosen: torch.Tensor  # [R] int64: the loop each row's logits came from
    draft_states: torch.Tensor  # [D, E, H]: every draft row's state after loops 0 .. E-1
    draft_gates: torch.Tensor | None  # [D, E]


def run_loops(model: OuroModel, loops: range, h, cos, sin, meta: AttentionMetadata, ops, each):
    """Rows ``h [N, H]`` through ``loops`` (final norm after each); ``each(t, h)`` sees the
    state after loop ``t``. Rows need not start at loop 0: ``h`` is their state before it."""
    eps = model.cfg.rms_norm_eps
    for t in loops:
        if h.shape[0]:
            for li in range(model.cfg.num_hidden_layers):
                h = model.layer(t, li, h, cos, sin, meta, ops)
            h = ops("rms_norm", h, model.norm, eps)
        each(t, h)
    return h


def _gates(model: OuroModel, x: torch.Tensor, prompt_samples: int) -> torch.Tensor:
    if not x.shape[0]:
        return x.new_empty(0)
    g = RowOps(model.kernels, prompt_samples if model.plan.split else None)(
        "exit_gate", x, model.gate_weight
    )
    return (g + model.gate_bias)[:, 0]  # [R]


@torch.inference_mode()
def forward(model: OuroModel, step: StepInputs, rows: LoopRows) -> LoopOutputs:
    E, T = rows.early, model.cfg.total_ut_steps
    A, D = rows.normal_rows, rows.draft_rows
    N, device = step.input_ids.shape[0], step.input_ids.device
    ops = RowOps(model.kernels, step.prompt_rows if model.plan.split else None)
    meta = step.attention
    first = rows.normal_requests + rows.draft_requests
    early_meta = meta.select(range(first))
    late_meta = meta.select([*range(rows.normal_requests), *range(first, meta.num_requests)])
    cos, sin = model.rope(step.positions, step.max_position)
    picked = step.sample_rows[: rows.normal_samples]  # normal rows whose logits are wanted
    ns = rows.normal_samples
    normal_hs: list[torch.Tensor] = []
    normal_gates: list[torch.Tensor] = []
    draft_hs: list[torch.Tensor] = []
    draft_gates: list[torch.Tensor] = []

    def collect(hs: list[torch.Tensor], gates: list[torch.Tensor]):
        """After each loop: the normal rows' state, and the state of rows ``A:`` into ``hs``
        (with their gates when some request is gated)."""

        def after(t: int, h: torch.Tensor) -> None:
            normal_hs.append(h.index_select(0, picked))
            hs.append(h[A:])
            if rows.gated:
                g = _gates(model, torch.cat((normal_hs[-1], hs[-1])), step.prompt_samples)
                normal_gates.append(g[:ns])
                gates.append(g[ns:])

        return after

    early = collect(draft_hs, draft_gates)

    h = F.embedding(step.input_ids[: A + D], model.embed)  # [A + D, H]
    h = run_loops(model, range(E), h, cos[:, : A + D], sin[:, : A + D], early_meta, ops, early)

    verify_hs: list[torch.Tensor] = [rows.verify_states[:, t] for t in range(E)]
    kept_gates = rows.verify_gates  # None: no verify row (or no gated request)
    if kept_gates is None:
        kept_gates = rows.verify_states.new_empty(rows.verify_states.shape[0], E)
    verify_gates = [kept_gates[:, t] for t in range(E)]

    late = collect(verify_hs, verify_gates)

    late_rows = torch.tensor([*range(A), *range(A + D, N)], dtype=torch.int64, device=device)
    h = torch.cat((h[:A], rows.verify_states[:, E - 1]))  # [A + V, H]
    run_loops(model, range(E, T), h, cos[:, late_rows], sin[:, late_rows], late_meta, ops, late)

    V = rows.verify_states.shape[0]
    modes = step.exit_modes[:ns] + step.exit_modes[ns + len(rows.draft_samples) :]
    hs = [torch.cat((normal_hs[t], verify_hs[t])) for t in range(T)]  # [ns + V, H] each
    gates = [torch.cat((normal_gates[t], verify_gates[t])) for t in range(T)] if rows.gated else []
    final = attrs.evolve(step, exit_modes=modes, host_sample_rows=tuple(range(ns + V)))
    if ns + V:
        logits, chosen = model._exit_logits(hs, gates, final, modes, None)
    else:
        logits = torch.empty(0, model.lm_head.shape[0], dtype=model.lm_head.dtype, device=device)
        chosen = torch.empty(0, dtype=torch.int64, device=device)
    drafted = torch.tensor(rows.draft_samples, dtype=torch.int64, device=device)
    if len(rows.draft_samples):  # loop E-1's choice: its state through the lm_head
        draft_logits = RowOps(model.kernels, 0)(
            "lm_head", draft_hs[E - 1].index_select(0, drafted), model.lm_head
        )
    else:
        draft_logits = logits[:0]
    draft_chosen = torch.full((len(rows.draft_samples),), E - 1, dtype=torch.int64, device=device)
    return LoopOutputs(
        torch.cat((logits[:ns], draft_logits, logits[ns:])),
        torch.cat((chosen[:ns], draft_chosen, chosen[ns:])),
        torch.stack(draft_hs, dim=1) if D else torch.empty(0, E, 0, device=device),
        torch.stack(draft_gates, dim=1) if D and rows.gated else None,
    )
