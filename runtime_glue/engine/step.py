"""The input builder: the scheduler's plan for a step, on the host, then on the device.

:class:`StepBuilder` turns the plan (which requests compute which rows) into a
:class:`HostStep`: every row's token and position, where its K/V lives at every (loop, layer)
plane (``hal.types.KVAddressing``: one metadata, or one per loop under kv sharing), which rows
are sampled and by which exit rule, the step's spans (laid out by ``runtime_glue.engine.spans``:
one of every row through every loop, two when some request drafts or verifies) and the kept
states verifies start from (``runtime_glue.ouro.records.Span``, ``Kept``). An eager step moves it to
the device with one copy (:meth:`HostStep.inputs`); a captured step graph loads the same
values into its static buffers (``runtime_glue.engine.graphs``). Both run
``OuroModel.forward``.

Rows, in order: prompt rows, generated rows, draft rows (loops 0 .. E-1 only), verify rows
(loops E .. T-1, from the states their draft steps kept). A verify request's k + 1 rows
enter the attention metadata as k + 1 one-row entries over the same pages, as plain decoding
computes them: within a layer every row's K/V is written before any row attends, so row ``i``
sees the rows before it. A step whose every entry has one row is *decode-only*.
"""

from __future__ import annotations

import attrs
import torch

from hal.types import KVAddressing
from runtime_glue.engine.depth_store import DepthStore
from runtime_glue.engine.kv_placement import KVPlacement
from runtime_glue.engine.request import Request
from runtime_glue.engine.spans import StepLayout, step_layout
from runtime_glue.engine.speculative import Entry
from runtime_glue.ouro.exits import ExitMode, ExitRule
from runtime_glue.ouro.records import DepthRows, Kept, Span, StepInputs


@attrs.frozen(kw_only=True)
class Scheduled:
    """One request's part of a step: ``n`` rows, ordinary or speculative (``entry``), or its
    next token's one row at ``loop`` (depth-wise batching; ``finishing``: the last loop;
    ``may_exit``: under adaptive depth, a loop after which its exit rule may let it leave)."""

    req: Request
    n: int
    entry: Entry | None = None
    loop: int | None = None
    finishing: bool = False
    may_exit: bool = False

    @property
    def kind(self) -> str:
        """ "prompt", "generated", "draft", "verify" or "depth": the row group it belongs to."""
        if self.entry is not None:
            return self.entry.kind
        if self.loop is not None:
            return "depth"
        return "prompt" if self.req.in_prefill else "generated"

    @property
    def ctx(self) -> int:
        return self.req.num_computed if self.entry is None else self.entry.ctx

    def samples(self) -> tuple[int, ...]:
        """Which of its rows are sampled (offsets): the last of a chunk that completes its
        tokens; every prompt row when the request wants prompt log-probabilities; every draft
        and verify row (a draft row's state is kept even when its token is not wanted); a depth
        row at its last loop or where it may exit."""
        if self.loop is not None:
            return (0,) if self.finishing or self.may_exit else ()
        if self.entry is not None:
            return tuple(range(self.n))
        if self.req.in_prefill and self.req.params.prompt_logprobs is not None:
            return tuple(range(self.n))  # each prompt row's logits score the next prompt token
        return (self.n - 1,) if self.req.num_computed + self.n == self.req.num_tokens else ()


@attrs.define(eq=False, kw_only=True)
class HostStep:
    """A step on the host. ``sampled``: the request of each sampled row, in order;
    ``rows_of[i]``: the sampled rows of ``plan[i]``."""

    plan: list[Scheduled]
    ids: list[int]
    positions: list[int]
    kv: KVAddressing  # host tensors
    groups: dict[str, int]  # rows per group: prompt, generated, draft, verify, depth
    entries: dict[str, int]  # attention entries per group
    sample_rows: list[int]
    sampled: list[Request]
    rows_of: list[list[int]]
    modes: list[ExitMode]
    loops: int  # T
    early: int | None  # E when some request drafts or verifies
    kept_states: list[torch.Tensor]  # [E, H] per verify row (device)
    kept_gates: list[torch.Tensor | None]
    drafted: list[tuple[int, ...]]  # per sampled row: its round's drafts before its position
    depth_rows: list[int] = attrs.field(factory=list)  # depth rows (step rows), ascending ...
    depth_slots: list[int] = attrs.field(factory=list)  # ... their tokens' store slots ...
    depth_loops: list[int] = attrs.field(factory=list)  # ... and the loop each runs
    depth_store: DepthStore | None = None

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def prompt_rows(self) -> int:
        return self.groups["prompt"]

    @property
    def prompt_samples(self) -> int:
        return sum(r < self.prompt_rows for r in self.sample_rows)

    @property
    def decode_only(self) -> bool:
        return self.kv.base.num_tokens == self.kv.base.num_requests and not self.prompt_rows

    @property
    def token_positions(self) -> list[int]:
        """The position of the token each sampled row chooses."""
        return [self.positions[r] + 1 for r in self.sample_rows]

    @property
    def gated(self) -> bool:
        """Whether the step computes the gate: some request exits by it (a draft row's own
        rule is a fixed loop, but its request's verify step will need the gates it kept)."""
        exits_by_gate = any(s.req.exit_mode.kind in ("threshold", "weighted") for s in self.plan)
        return exits_by_gate and bool(self.sample_rows or self.depth_rows)

    def exit_columns(self) -> list[list[int]]:
        return list(ExitRule.host_values(self.modes, self.loops))

    def inputs(self, device: torch.device, pin: bool = False) -> StepInputs:
        """The step on ``device``, moved with one copy: what an eager step runs."""
        layout = step_layout(self.groups, self.entries, self.sample_rows, self.loops, self.early)
        host = [self.ids, self.positions, self.sample_rows, *self.exit_columns()]
        kv, moved = self.kv.to(device, *_host_tensors(host, layout, self._depth_lists()), pin=pin)
        ids, positions, sample_rows, step, use, bits = moved[:6]
        spans = 3 * len(layout.spans)
        weighted = tuple(i for i, m in enumerate(self.modes) if m.kind == "weighted")
        return StepInputs(
            input_ids=ids,
            positions=positions,
            kv=kv,
            sample_rows=sample_rows,
            prompt_rows=self.prompt_rows,
            prompt_samples=self.prompt_samples,
            max_position=max(self.positions),
            exits=ExitRule(
                step=step, use_threshold=use, threshold=bits, weighted=weighted, gated=self.gated
            ),
            host_sample_rows=tuple(self.sample_rows),
            spans=_spans(layout, kv, moved[6:], self.prompt_rows),
            kept=self._kept(moved[6 + spans : 8 + spans]),
            depth=self._depth(moved[6 + spans : 13 + spans]),
            modes=tuple(self.modes),
        )

    def _kept(self, t: list[torch.Tensor]) -> Kept | None:
        """The verify rows' kept states (``t``: their rows and samples, on the device); a
        depth step's sampled rows read theirs from the store (:meth:`_depth`)."""
        if not self.kept_states:
            return None
        states = torch.stack(self.kept_states)  # [V, E, H]
        gates = None
        if self.gated:
            like = states.new_zeros(states.shape[1])
            gates = torch.stack([like if g is None else g for g in self.kept_gates])
        return Kept(rows=t[0], samples=t[1], states=states, gates=gates)

    def _depth_lists(self) -> tuple[list[int], ...]:
        """The depth rows, their slots and loops; then the sampled ones' slots and loops (the
        layout's kept rows, in its order)."""
        if not self.depth_rows:
            return ()
        where = {row: i for i, row in enumerate(self.depth_rows)}
        kept = [where[row] for row in self.sample_rows if row in where]
        slots, loops = self.depth_slots, self.depth_loops
        return (self.depth_rows, slots, loops, [slots[i] for i in kept], [loops[i] for i in kept])

    def _depth(self, t: list[torch.Tensor]) -> DepthRows | None:
        """The depth rows (``t``: the layout's kept rows and samples, then
        :meth:`_depth_lists`, on the device)."""
        if not self.depth_rows:
            return None
        store = self.depth_store
        assert store is not None
        fills = store.exits and any(s.may_exit for s in self.plan)
        return DepthRows(rows=t[2], slots=t[3], loops=t[4], states=store.states,
                         gates=store.gates, kept_rows=t[0], kept_samples=t[1], kept_slots=t[5],
                         kept_loops=t[6], fills=fills)  # fmt: skip


def _host_tensors(
    host: list[list[int]], layout: StepLayout, depth: tuple[list[int], ...] = ()
) -> list[torch.Tensor]:
    """A step's row fields, then every span's indices, the kept rows' and the depth rows', as
    host tensors."""
    spans = [list(v) for s in layout.spans for v in (s.rows, s.samples, s.sample_at)]
    kept = [list(layout.kept), list(layout.kept_samples)]
    return [torch.tensor(v, dtype=torch.int64) for v in (*host, *spans, *kept, *depth)]


def _spans(
    layout: StepLayout, kv: KVAddressing, t: list[torch.Tensor], prompt_rows: int
) -> tuple[Span, ...]:
    """The layout's spans on the device (``t``: each span's rows, samples and sample_at);
    a span of every attention entry is addressed as the step is."""
    every = tuple(range(kv.base.num_requests))
    rows = kv.base.num_tokens
    return tuple(
        Span(
            loops=s.loops,
            rows=t[3 * i],
            kv=kv if s.entries == every else kv.select(s.entries),
            samples=t[3 * i + 1],
            sample_at=t[3 * i + 2],
            prompt_rows=prompt_rows,
            whole=len(s.rows) == rows,
        )
        for i, s in enumerate(layout.spans)
    )


class StepBuilder:
    """Builds every step's :class:`HostStep` (``kv``: where each request's K/V lives,
    ``runtime_glue.engine.kv_placement``; ``early``: the draft's loops when speculation is
    on; ``depth``: where depth-wise tokens keep their states, under depth-wise batching)."""

    def __init__(self, cfg, kv: KVPlacement, early: int | None, depth: DepthStore | None = None):
        self.layers, self.loops = cfg.num_hidden_layers, cfg.total_ut_steps
        self.kv, self.early, self.depth = kv, early, depth

    def build(self, plan: list[Scheduled]) -> HostStep:
        ids: list[int] = []
        positions: list[int] = []
        entries: list[tuple] = []
        groups = dict.fromkeys(("prompt", "generated", "draft", "verify", "depth"), 0)
        counts = dict(groups)
        sample_rows: list[int] = []
        sampled: list[Request] = []
        rows_of: list[list[int]] = []
        modes: list[ExitMode] = []
        kept_states: list[torch.Tensor] = []
        kept_gates: list[torch.Tensor | None] = []
        drafted: list[tuple[int, ...]] = []
        depth_rows: list[int] = []
        depth_slots: list[int] = []
        depth_loops: list[int] = []
        for s in plan:
            req, ctx, start, spec = s.req, s.ctx, len(ids), s.entry
            ids += req.tokens(ctx, ctx + s.n) if spec is None else list(spec.ids)
            positions += range(ctx, ctx + s.n)
            rows = [(s.n, ctx)] if s.kind != "verify" else [(1, ctx + i) for i in range(s.n)]
            entries += [self.kv.entry(req, n, c, s.loop or 0) for n, c in rows]
            groups[s.kind] += s.n
            counts[s.kind] += len(rows)
            mine = [start + i for i in s.samples()]
            rows_of.append(list(range(len(sample_rows), len(sample_rows) + len(mine))))
            sample_rows += mine
            sampled += [req] * len(mine)
            own = spec.mode if spec is not None and spec.mode is not None else req.exit_mode
            modes += [own] * len(mine)
            drafted += [() if spec is None else spec.history(i) for i in s.samples()]
            if spec is not None:
                kept_states += spec.states
                kept_gates += spec.gates
            if s.loop is not None:
                assert self.depth is not None, "a depth row needs the engine's DepthStore"
                token = self.depth.token(req)
                assert token.loop == s.loop, "scheduled at another loop than its token's"
                depth_rows.append(start)
                depth_slots.append(token.slot)
                depth_loops.append(s.loop)
        speculative = groups["draft"] + groups["verify"] > 0
        return HostStep(
            plan=plan,
            ids=ids,
            positions=positions,
            kv=self.kv.addressing(entries),
            groups=groups,
            entries=counts,
            sample_rows=sample_rows,
            sampled=sampled,
            rows_of=rows_of,
            modes=modes,
            loops=self.loops,
            early=self.early if speculative else None,
            kept_states=kept_states,
            kept_gates=kept_gates,
            drafted=drafted,
            depth_rows=depth_rows,
            depth_slots=depth_slots,
            depth_loops=depth_loops,
            depth_store=self.depth,
        )


def sequence_inputs(
    device: torch.device,
    kv: KVAddressing,
    ids: list[int],
    ctx: int,
    prompt: bool,
    modes: list[ExitMode],
    loops: int,
    sample_rows: list[int] | None = None,
) -> StepInputs:
    """One sequence's rows ``ids`` at positions ``ctx ..``, outside the engine (perplexity,
    evaluation): every row a prompt position or every row a generated one; ``sample_rows``
    (default every row) by ``modes``, one each. ``kv``: host addressing of those rows."""
    n = len(ids)
    rows = list(range(n)) if sample_rows is None else sample_rows
    kinds = {"prompt": prompt, "generated": not prompt, "draft": False, "verify": False}
    groups = {kind: n if on else 0 for kind, on in kinds.items()}
    entries = {kind: kv.base.num_requests if on else 0 for kind, on in kinds.items()}
    layout = step_layout(groups, entries, rows, loops, None)
    step, use, bits = ExitRule.host_values(modes, loops)
    host = [ids, list(range(ctx, ctx + n)), rows, step, use, bits]
    kv, moved = kv.to(device, *_host_tensors(host, layout))
    weighted = tuple(i for i, m in enumerate(modes) if m.kind == "weighted")
    gated = any(m.kind in ("threshold", "weighted") for m in modes)
    prompt_rows = n if prompt else 0
    return StepInputs(
        input_ids=moved[0],
        positions=moved[1],
        kv=kv,
        sample_rows=moved[2],
        prompt_rows=prompt_rows,
        prompt_samples=len(rows) if prompt else 0,
        max_position=ctx + n - 1,
        exits=ExitRule(
            step=moved[3],
            use_threshold=moved[4],
            threshold=moved[5],
            weighted=weighted,
            gated=gated,
        ),
        host_sample_rows=tuple(rows),
        spans=_spans(layout, kv, moved[6:], prompt_rows),
        modes=tuple(modes),
    )
