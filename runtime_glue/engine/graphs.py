"""Step graphs in the engine (``--step-graphs``): decode steps captured once per shape, replayed.

What is captured: a *decode-only* step, in which every request computes one generated
position and reads its logits from a fixed loop, the last, or by an exit threshold (the
checkpoint's default). Its whole forward (embedding, every loop and layer with its KV writes,
the exit choice, the lm_head, the greedy pick and the packed logits) is one graph per shape:
a padded batch size and a context bucket (a power of two of KV blocks). What runs eagerly:
steps with prompt positions (prefill, chunks, recomputation after preemption), weighted exits,
and shapes past the largest bucket.

Per step the engine writes the step's data into a host staging buffer, copies it into the
shape's static device buffer with one copy, replays, and reads back the picks (or the logits)
with one copy: a few host calls instead of thousands of op launches
(``runtime_glue.bench.graph_bench`` counts them).

Padding rows compute garbage of their own, never anyone else's: each writes its K/V to a
scratch slot in pages the runner takes from the pool for good, and reads only scratch pages.
A real row's table entries past its context repeat its first page; they are masked (a masked
position adds an exact zero, which needs finite K/V there, hence its own page).

Padding changes the row count of every projection. In deterministic mode the plan's kernels
are row-invariant (checked at start-up), so the batch sizes are powers of two; in HF-exact
and fast modes a row count is part of the arithmetic (HF's, or a GEMM's that was never
checked for row invariance), so every batch size up to ``max_num_seqs`` has its own graph
and no row is padded.

Admitted on the device (:meth:`StepGraphRunner.admit`): before the engine serves, one shape is
captured on synthetic rows in the scratch pages and replayed on other rows (other tokens,
positions and exit rules); the replay must give the logits and exit loops of the same step
run eagerly through ``OuroModel.forward``, bit for bit. Otherwise the engine runs every step
eagerly and the plan says why.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from hal.graphs import StaticDecodeMetadata, StepGraph, StepGraphs, context_bucket
from hal.interfaces import Device, Driver
from hal.types import AttentionMetadata, check_slot_mapping
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.request import Request
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.model import OuroModel, RowOps, StepInputs
from runtime_glue.ouro.plan import Admission, ExecutionPlan

logger = logging.getLogger(__name__)

FIELDS = ("ids", "positions", "slots", "seq_lens", "exit_step", "use_threshold", "threshold")


def require_step_graphs(driver: Driver, plan: ExecutionPlan) -> StepGraphs:
    """The driver's step graphs for ``plan``, or a ValueError that says why there are none."""
    graphs = driver.step_graphs()
    if graphs is None:
        raise ValueError(
            f"--step-graphs: driver {driver.name!r} offers no step graphs (cuda and npu do; "
            "on cpu every op is already a host call)"
        )
    backend = driver.backend(plan.attention)
    if not backend.step_graphs:
        raise ValueError(
            f"--step-graphs: attention backend {backend.name!r} has no graph-safe decode form "
            "(hal.graphs.StaticDecodeMetadata); choose an *_eager backend"
        )
    if plan.adaptive_depth:
        raise ValueError(
            "--step-graphs cannot be combined with --adaptive-depth: deciding which rows "
            "leave after each loop reads the device, which a graph cannot"
        )
    return graphs


def batch_sizes(mode: str, max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes to capture (see the module docstring for why they depend on mode)."""
    if mode != "deterministic":
        return tuple(range(1, max_num_seqs + 1))
    pow2 = [2**i for i in range(max_num_seqs.bit_length()) if 2**i <= max_num_seqs]
    return tuple(sorted({*pow2, max_num_seqs}))


def bf16_bits(x: float) -> int:
    """The bfloat16 bit pattern torch gives a Python float (via float32, nearest even)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


class _Buffers:
    """The static inputs of one shape: views of one int64 device buffer that one copy fills
    from a (pinned) host staging buffer."""

    def __init__(self, rows: int, blocks: int, device: torch.device, pin: bool) -> None:
        self.rows, self.blocks = rows, blocks
        size = len(FIELDS) * rows + rows * blocks
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.device = torch.zeros(size, dtype=torch.int64, device=device)
        self.pin = pin
        self.view = {name: self.device[i * rows : (i + 1) * rows] for i, name in enumerate(FIELDS)}
        self.tables = self.device[len(FIELDS) * rows :].view(rows, blocks)
        self.sample_rows = torch.arange(rows, device=device)

    def load(self, values: list[int]) -> None:
        """This step's data into the static buffer, in place (the graph reads it there).

        The previous step's copy has finished: its results were read back, which waited."""
        self.host.numpy()[:] = values
        self.device.copy_(self.host, non_blocking=self.pin)


def static_forward(model: OuroModel, buf: _Buffers):
    """The decode step ``model.forward`` computes, in static shapes and without host reads:
    ``(logits [B, V], chosen loop [B], picks [2, B], packed [B, V + 1])``."""
    v, cfg, rows = buf.view, model.cfg, buf.rows
    meta = StaticDecodeMetadata.of(
        model.kv.layout.block_size, v["slots"], buf.tables, v["seq_lens"]
    )
    # The model reads the metadata only through its attention backend (EagerBackend.forward).
    static: Any = meta
    step = StepInputs(
        v["ids"], v["positions"], static, buf.sample_rows, 0, 0, 0, (), (*range(rows),)
    )
    ops = RowOps(model.kernels, 0 if model.plan.split else None)
    h = F.embedding(v["ids"], model.embed)  # [B, H]
    cos, sin = model.rope(v["positions"], 0)  # the table was built for every position
    hs, gates = [], []
    for t in range(cfg.total_ut_steps):
        h = model.loop(t, h, cos, sin, meta, ops)
        sampled_h = h.index_select(0, buf.sample_rows)
        hs.append(sampled_h)
        gates.append(model._gate(h, sampled_h, step))
    chosen = _exit_steps(model._pdf(gates, step), v)
    stacked = torch.stack(hs)  # [T, B, H]
    selected = stacked[chosen, buf.sample_rows]  # [B, H]
    logits = model._sampled_ops(step)("lm_head", selected, model.lm_head)  # [B, V]
    picks = torch.stack((logits.argmax(-1), chosen))
    packed = torch.cat((logits.float(), chosen[:, None].float()), 1)
    return logits, chosen, picks, packed


def _exit_steps(pdf: torch.Tensor, v: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's loop: its fixed one, or its threshold's (``exits.threshold_steps``, with the
    threshold a per-row tensor of the bf16 value the eager comparison rounds it to)."""
    threshold = v["threshold"].to(torch.int16).view(torch.bfloat16).to(pdf.dtype)
    reached = torch.cumsum(pdf, dim=-1) >= threshold[:, None]
    first = torch.argmax(reached.float(), dim=-1)
    by_threshold = torch.where(reached.any(dim=-1), first, pdf.shape[-1] - 1)
    return torch.where(v["use_threshold"].bool(), by_threshold, v["exit_step"])


class StepGraphRunner:
    """Captures decode-only steps lazily, one graph per (batch size, context bucket)."""

    def __init__(
        self,
        graphs: StepGraphs,
        model: OuroModel,
        device: Device,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.graphs, self.model, self.device = graphs, model, device
        self.block_size = bs = allocator.block_size
        self.sizes = batch_sizes(model.plan.mode, max_num_seqs)
        max_blocks = min(-(-max_model_len // bs), allocator.num_blocks)
        self.buckets = tuple(2**i for i in range(context_bucket(max_blocks).bit_length()))
        pad_rows = max(1, self.sizes[-1] - 1)
        scratch = allocator.allocate(-(-pad_rows // bs))
        if scratch is None:
            raise ValueError(
                f"--step-graphs needs {-(-pad_rows // bs)} scratch KV block(s) for padding "
                f"rows, but the pool has {allocator.num_free} free"
            )
        self.scratch = scratch
        # The cos/sin table for every position a request can reach, before any capture: a
        # graph keeps the table it saw, so it must never be reallocated afterwards.
        reach = min(max_model_len, allocator.num_blocks * bs)
        model.rope(torch.zeros(1, dtype=torch.int64, device=device.torch_device), reach)
        self._graphs: dict[tuple[int, int], tuple[StepGraph, _Buffers, tuple]] = {}
        self.stats = {"graph_steps": 0, "eager_steps": 0, "captures": 0}

    @property
    def label(self) -> str:
        return self.graphs.label

    def shape_for(self, plan: list[tuple[Request, int]]) -> tuple[int, int] | None:
        """The captured shape a step runs in, or None if it must run eagerly."""
        if self.model.recorder is not None:
            return None
        for req, n in plan:
            if n != 1 or req.in_prefill or req.exit_mode.kind == "weighted":
                return None
        rows = next((s for s in self.sizes if s >= len(plan)), None)
        blocks = context_bucket(
            max(-(-(req.num_computed + 1) // self.block_size) for req, _ in plan)
        )
        return None if rows is None or blocks > self.buckets[-1] else (rows, blocks)

    def run(self, plan: list[tuple[Request, int]]):
        """Replay the step's graph: ``(sampled, logits, exits, picks, packed)`` (device views of
        the graph's outputs, real rows only), or None when the step must run eagerly."""
        shape = self.shape_for(plan)
        if shape is None:
            self.stats["eager_steps"] += 1
            return None
        with torch.inference_mode():
            entry = self._graphs.get(shape)
            values = self._values(plan, *shape)
            if entry is None:
                entry = self._capture(shape, values)
            else:
                entry[1].load(values)
            graph, _, outputs = entry
            graph.replay()
        self.stats["graph_steps"] += 1
        n = len(plan)
        logits, chosen, picks, packed = outputs
        return [r for r, _ in plan], logits[:n], chosen[:n], picks[:, :n], packed[:n]

    def _capture(self, shape: tuple[int, int], values: list[int]):
        buf = _Buffers(*shape, self.device.torch_device, self.device.pin_memory)
        buf.load(values)
        graph, outputs = self.graphs.capture(lambda: static_forward(self.model, buf))
        self._graphs[shape] = entry = (graph, buf, outputs)
        self.stats["captures"] += 1
        logger.info("captured a %s for %d rows x %d blocks", self.label, *shape)
        return entry

    def _values(self, plan: list[tuple[Request, int]], rows: int, blocks: int) -> list[int]:
        """The static buffer's contents for this step, built on the host."""
        bs, last = self.block_size, self.model.cfg.total_ut_steps - 1
        out: list[Row] = []
        for req, _ in plan:
            ctx, mode = req.num_computed, req.exit_mode
            used = req.blocks[: -(-(ctx + 1) // bs)]
            out.append(Row(req.tokens(ctx, ctx + 1)[0], ctx, used, mode))
        check_slot_mapping([r.slot(bs) for r in out], self.model.kv.layout.num_slots)
        for j in range(rows - len(plan)):  # padding rows: scratch pages only
            out.append(Row(0, j % bs, [self.scratch[j // bs]]))
        return flatten(out, bs, blocks, last)

    def admit(self) -> Admission:
        """Capture one shape on synthetic rows (the scratch pages), replay it on other rows
        and compare with the same step run eagerly: admitted iff bit for bit equal."""
        bs, model = self.block_size, self.model
        capacity = len(self.scratch) * bs
        rows = max(s for s in self.sizes if s <= capacity)
        shape = (rows, 1)  # positions within one page: context bucket 1
        gen = torch.Generator().manual_seed(rows)
        vocab, last = model.cfg.vocab_size, model.cfg.total_ut_steps - 1
        modes = [ExitMode(), ExitMode(step=min(1, last)), ExitMode(threshold=0.5), ExitMode()]

        def synthetic(permute: bool) -> list[Row]:
            ids = torch.randint(0, vocab, (rows,), generator=gen).tolist()
            offsets = list(range(rows))[:: -1 if permute else 1]  # every offset in the step
            return [
                Row(ids[j], offsets[j] % bs, [self.scratch[offsets[j] // bs]],
                    modes[j % len(modes)] if permute else ExitMode())
                for j in range(rows)
            ]  # fmt: skip

        label = f"at {rows} row(s) x 1 block"
        try:
            with torch.inference_mode():
                self._capture(shape, flatten(synthetic(False), bs, 1, last))
                trial = synthetic(True)
                eager = self._eager(trial)
                graph, buf, outputs = self._graphs[shape]
                buf.load(flatten(trial, bs, 1, last))
                graph.replay()
                replayed = (outputs[0][:rows].clone(), outputs[1][:rows].clone())
        except Exception as exc:  # noqa: BLE001 - any failure to capture or replay refuses it
            self._graphs.clear()
            return Admission("step_graphs", self.label, False,
                             f"{label}: cannot capture or replay here: {type(exc).__name__}: {exc}")  # fmt: skip
        same_logits = torch.equal(replayed[0], eager[0])
        same_exits = torch.equal(replayed[1].to(eager[1].dtype), eager[1])
        if same_logits and same_exits:
            return Admission("step_graphs", self.label, True,
                             f"{label}: replay equals the eager step bit for bit (logits, exit "
                             "loops) on other tokens, positions and exit rules than captured",
                             0.0, 0.0)  # fmt: skip
        self._graphs.clear()
        diff = (replayed[0].float() - eager[0].float()).abs().max().item()
        what = " and ".join(
            [f"logits (max difference {diff:.3g})"] * (not same_logits)
            + ["exit loops"] * (not same_exits)
        )
        return Admission("step_graphs", self.label, False,
                         f"{label}: replay differs from the eager step in its {what}; "
                         "every step runs eagerly", diff)  # fmt: skip

    def _eager(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """``OuroModel.forward`` on ``rows`` as one eager decode step (the engine's path)."""
        bs, device = self.block_size, self.device.torch_device
        meta = AttentionMetadata.build(
            bs, [(1, r.position, r.blocks) for r in rows], self.model.kv.layout.num_slots
        ).to(device)[0]
        n = len(rows)
        step = StepInputs(
            torch.tensor([r.token for r in rows], device=device),
            torch.tensor([r.position for r in rows], device=device),
            meta,
            torch.arange(n, device=device),
            0,
            0,
            max(r.position for r in rows),
            tuple(r.mode for r in rows),
            tuple(range(n)),
        )
        logits, chosen = self.model.forward(step)
        return logits, chosen


@attrs.frozen
class Row:
    """One row of a captured decode step: its token, position, blocks and exit rule."""

    token: int
    position: int
    blocks: list[int]  # the blocks its context occupies (the last holds its new token)
    mode: ExitMode = attrs.field(factory=ExitMode)  # a fixed loop, a threshold or the last

    def slot(self, block_size: int) -> int:
        return self.blocks[self.position // block_size] * block_size + self.position % block_size


def flatten(rows: list[Row], block_size: int, blocks: int, last: int) -> list[int]:
    """The static buffer's contents for ``rows`` (``FIELDS``, then the block tables): a
    table's entries past a row's context repeat its first block (masked: finite K/V)."""
    cols: dict[str, list[int]] = {name: [] for name in FIELDS}
    tables: list[int] = []
    for r in rows:
        mode = r.mode  # a fixed loop, a threshold, or the last loop
        for name, value in (
            ("ids", r.token),
            ("positions", r.position),
            ("slots", r.slot(block_size)),
            ("seq_lens", r.position + 1),
            ("exit_step", mode.step if mode.step is not None else last),
            ("use_threshold", int(mode.kind == "threshold")),
            ("threshold", bf16_bits(mode.threshold) if mode.threshold is not None else 0),
        ):
            cols[name].append(value)
        tables += r.blocks + r.blocks[:1] * (blocks - len(r.blocks))
    return [x for name in FIELDS for x in cols[name]] + tables
