"""The static inputs of a captured step shape (``runtime_glue.engine.graphs``): the shape, the
device buffers a graph reads, the step they hold as ``OuroModel.forward`` takes it, and
:func:`stage`, which lays a built step (``HostStep``) out in them.

One int64 buffer holds every row field, each table's slots and block tables (and a depth-wise
step's sampled rows), so one copy from a (pinned) host staging buffer fills it; the verify rows'
kept states take another. Padding rows of each group read and write scratch pages only (a
depth row's state, the store's scratch slot); a real row's table entries past its context
repeat its first page (masked).

A depth-wise step (``--depth-batching``) is its own shape: its rows, padded, each at its own
loop (a row field), and the rows it samples (those at their last loop or at a loop they may
leave after), padded: one graph per row count and sample count whatever the loops (in the
HF-exact and fast modes every pair its own graph, as every row count is). Its tokens' states
stay in the store (``runtime_glue.engine.depth_store``), which the graph reads and writes in
place. A graph computes every row's gate and fills the planes of every sampled row when tokens
may leave; an eager step only where some row needs them: no output depends on the
difference (a row that reads gates is gated at every step, and a filled plane of a row that
stays is written again before anything reads it).
"""

from __future__ import annotations

import attrs
import torch

from hal.graphs import StaticDecodeMetadata
from hal.types import KVAddressing, check_slot_mapping
from runtime_glue.engine.spans import step_layout
from runtime_glue.engine.step import HostStep
from runtime_glue.ouro.exits import ExitRule
from runtime_glue.ouro.model import OuroModel
from runtime_glue.ouro.records import DepthRows, Kept, Span, StepInputs

GROUPS = ("generated", "draft", "verify", "depth")
ROW_FIELDS = (
    "ids", "positions", "seq_lens", "exit_step", "use_threshold", "threshold", "slot", "loop"
)  # fmt: skip


def sizes_up_to(mode: str, most: int) -> tuple[int, ...]:
    """A group's captured sizes (why they depend on mode: ``runtime_glue.engine.graphs``)."""
    if most < 1:
        return (0,)
    if mode != "deterministic":
        return tuple(range(0, most + 1))
    pow2 = [2**i for i in range(most.bit_length()) if 2**i <= most]
    return tuple(sorted({0, *pow2, most}))


@attrs.frozen
class Shape:
    """A captured shape: rows per group (padded), the context bucket in blocks and, for a
    depth-wise step, its sampled rows (padded; None: every row is sampled)."""

    rows: tuple[int, int, int, int]  # generated, draft, verify, depth
    blocks: int
    samples: int | None = None

    @property
    def total(self) -> int:
        return sum(self.rows)


class StaticBuffers:
    """The static inputs of one shape: views of one int64 device buffer that one copy fills
    from a (pinned) host staging buffer, and the verify rows' kept states."""

    def __init__(
        self, shape: Shape, tables: int, model: OuroModel, device, pin: bool, early, store
    ):
        B, W, S = shape.total, shape.blocks, shape.samples or 0
        self.shape, self.tables, self.store = shape, tables, store
        size = len(ROW_FIELDS) * B + tables * B + tables * B * W + S
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.device = torch.zeros(size, dtype=torch.int64, device=device)
        self.pin = pin
        self.view = {n: self.device[i * B : (i + 1) * B] for i, n in enumerate(ROW_FIELDS)}
        at = len(ROW_FIELDS) * B
        self.slots = self.device[at : at + tables * B].view(tables, B)
        self.block_tables = self.device[at + tables * B : size - S].view(tables, B, W)
        self.samples = self.device[size - S :]  # a depth-wise step's sampled rows
        g, d, v, _ = shape.rows
        E, H = early or 1, model.cfg.hidden_size
        self.kept_states = torch.zeros(v, E, H, dtype=model.embed.dtype, device=device)
        self.kept_gates = torch.zeros(v, E, dtype=model.embed.dtype, device=device)
        self.no_gates = torch.zeros(E, dtype=model.embed.dtype, device=device)  # kept none
        rows = range(B)  # every row of a plain captured step is sampled, each its own entry

        def index(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.sample_rows = index(rows)  # (a depth-wise step's: every row, its one span)
        if shape.samples is not None:  # a depth-wise step lays itself out (_depth_inputs)
            return
        groups = {"prompt": 0, "generated": g, "draft": d, "verify": v}
        self.layout = step_layout(groups, groups, rows, model.cfg.total_ut_steps, early)
        self.span_index = [
            (index(s.rows), index(s.samples), index(s.sample_at)) for s in self.layout.spans
        ]
        self.kept_index = (index(self.layout.kept), index(self.layout.kept_samples))

    def load(self, values: list[int], host: HostStep | None) -> None:
        """This step's data into the static buffers, in place (the graph reads them there).
        The previous step's copy has finished: its results were read back, which waited; a
        step that reads nothing back (a depth-wise step sampling no row) copies blocking, so
        that the next load may overwrite the host staging buffer."""
        self.host.numpy()[:] = values
        self.device.copy_(self.host, non_blocking=self.pin and self.shape.samples != 0)
        if host is not None and host.kept_states:
            n = len(host.kept_states)
            self.kept_states[:n].copy_(torch.stack(host.kept_states))
            if host.gated:
                gates = [self.no_gates if g is None else g for g in host.kept_gates]
                self.kept_gates[:n].copy_(torch.stack(gates))


def static_inputs(model: OuroModel, buf: StaticBuffers, early: int | None) -> StepInputs:
    """The step the static buffers hold, as ``OuroModel.forward`` takes it (ops inside the
    captured graph: the gather slots, the masks, the spans' selections)."""
    v, bs, cfg = buf.view, model.kv.layout.block_size, model.cfg
    num_slots = model.kv.layout.num_slots

    def kv_of(rows: torch.Tensor | None) -> KVAddressing:
        metas = []
        for t in range(buf.tables):
            slots, tables, lens = buf.slots[t], buf.block_tables[t], v["seq_lens"]
            if rows is not None:
                slots, tables, lens = (x.index_select(0, rows) for x in (slots, tables, lens))
            metas.append(StaticDecodeMetadata.of(bs, slots, tables, lens))
        return KVAddressing(cfg.num_hidden_layers, num_slots, tuple(metas))

    B = buf.shape.total
    whole = kv_of(None)
    if buf.shape.samples is not None:
        return _depth_inputs(buf, whole)
    rule = ExitRule(
        step=v["exit_step"], use_threshold=v["use_threshold"], threshold=v["threshold"], gated=True
    )
    spans = tuple(
        Span(
            loops=s.loops,
            rows=rows,
            kv=whole if len(s.entries) == B else kv_of(rows),
            samples=samples,
            sample_at=at,
            prompt_rows=0,
            whole=len(s.rows) == B,
        )
        for s, (rows, samples, at) in zip(buf.layout.spans, buf.span_index, strict=True)
    )
    assert (early is None) == (len(spans) == 1), "early disagrees with the buffers' layout"
    kept = None
    if early is not None:
        rows, samples = buf.kept_index
        kept = Kept(rows=rows, samples=samples, states=buf.kept_states, gates=buf.kept_gates)
    return StepInputs(
        input_ids=v["ids"],
        positions=v["positions"],
        kv=whole,
        sample_rows=buf.sample_rows,
        prompt_rows=0,
        prompt_samples=0,
        max_position=0,
        exits=rule,
        host_sample_rows=tuple(range(B)),
        spans=spans,
        kept=kept,
    )


def _depth_inputs(buf: StaticBuffers, whole: KVAddressing) -> StepInputs:
    """A depth-wise step's static inputs: every row one pass over the layers at its own loop
    (its addressing shifted there), the sampled rows' exit rules and states by the rows the
    buffer names (``OuroModel._depth_pass``)."""
    v, samples = buf.view, buf.samples
    S = samples.shape[0]
    every = buf.sample_rows
    rule = ExitRule(
        step=v["exit_step"].index_select(0, samples),
        use_threshold=v["use_threshold"].index_select(0, samples),
        threshold=v["threshold"].index_select(0, samples),
        gated=True,
    )
    none = every[:0]
    span = Span(loops=range(1), rows=every, kv=whole, samples=none, sample_at=none,
                prompt_rows=0, whole=True)  # fmt: skip
    depth = DepthRows(
        rows=every,
        slots=v["slot"],
        loops=v["loop"],
        states=buf.store.states,
        gates=buf.store.gates,
        kept_rows=samples,
        kept_samples=every[:S],
        kept_slots=v["slot"].index_select(0, samples),
        kept_loops=v["loop"].index_select(0, samples),
        fills=buf.store.exits,
    )
    return StepInputs(
        input_ids=v["ids"],
        positions=v["positions"],
        kv=whole,
        sample_rows=samples,
        prompt_rows=0,
        prompt_samples=0,
        max_position=0,
        exits=rule,
        host_sample_rows=tuple(range(S)),  # (read for its length: the sampled rows' count)
        spans=(span,),
        depth=depth,
    )


def stage(
    host: HostStep, shape: Shape, scratch: list[int], block_size: int
) -> tuple[list[int], list[int]]:
    """The static buffer's contents for this step (padding rows in each group read and
    write the ``scratch`` pages only), and where the step's real sampled rows sit among the
    padded ones (a depth-wise step's: among its padded samples)."""
    W = shape.blocks
    metas = host.kv.loops
    rule = host.exit_columns()
    sampled = {row: r for r, row in enumerate(host.sample_rows)}
    store = host.depth_store
    scratch_slot = store.scratch if store is not None else 0
    cols: dict[str, list[int]] = {n: [] for n in ROW_FIELDS}
    slots: list[list[int]] = [[] for _ in metas]
    tables: list[list[int]] = [[] for _ in metas]
    real: list[int] = []
    start, padded = 0, 0
    host_slots = [meta.slot_mapping.tolist() for meta in metas]  # host tensors, read once
    host_tables = [meta.block_tables.tolist() for meta in metas]
    depth = {
        row: (host.depth_slots[d], host.depth_loops[d]) for d, row in enumerate(host.depth_rows)
    }
    last = host.loops - 1
    for group, size in zip(GROUPS, shape.rows, strict=True):
        n = host.groups[group]
        for i in range(start, start + n):
            real.append(padded + i - start)
            r = sampled.get(i)  # a depth row: only at its last loop or one it may leave after
            assert r is not None or shape.samples is not None, "a plain step samples every row"
            exit_rule = (last, 0, 0) if r is None else (rule[0][r], rule[1][r], rule[2][r])
            slot, loop = depth.get(i, (scratch_slot, 0))
            p = host.positions[i]
            for name, value in zip(ROW_FIELDS, (host.ids[i], p, p + 1, *exit_rule, slot, loop),
                                   strict=True):  # fmt: skip
                cols[name].append(value)
            used = -(-(p + 1) // block_size)
            for t in range(len(metas)):
                slots[t].append(host_slots[t][i])
                row = host_tables[t][i][:used]
                tables[t] += row + row[:1] * (W - len(row))
        for j in range(size - n):  # padding rows: scratch pages only
            pad = padded + n + j
            page = scratch[pad // block_size]
            for name, value in zip(ROW_FIELDS, (0, pad % block_size, pad % block_size + 1,
                                   last, 0, 0, scratch_slot, 0), strict=True):  # fmt: skip
                cols[name].append(value)
            for t in range(len(metas)):
                slots[t].append(page * block_size + pad % block_size)
                tables[t] += [page] * W
        start += n
        padded += size
    check_slot_mapping(slots[0], None)
    flat = [x for n in ROW_FIELDS for x in cols[n]]
    flat += [x for s in slots for x in s] + [x for t in tables for x in t]
    if shape.samples is None:  # every row sampled: the real ones among the padded
        return flat, real
    # A depth-wise step's rows lead (its only group); padding samples are rows it does not
    # sample (padding rows first), each once: what they compute is dropped.
    samples = list(host.sample_rows)
    others = [r for r in reversed(range(padded)) if r not in sampled]
    samples += others[: shape.samples - len(samples)]
    return flat + samples, list(range(len(host.sample_rows)))
