"""Step graphs in the engine (``--step-graphs``): decode-only steps captured once per shape.

What is captured: ``OuroModel.forward`` itself (and the read-back forms of its logits) over a
*decode-only* step, whose every attention entry is one row: plain decoding, speculative
draft steps and verify steps (a verify request's rows are one-row entries,
``runtime_glue.engine.step``), depth-wise steps (``--depth-batching``: each row one loop of its
token, at whichever loop; its state in the store the graph reads and writes in place), every
exit rule but weighted exits, under any plan and with kv sharing (one table per loop). One
graph per shape: the rows of each group (generated, draft, verify, depth), padded, a depth-wise
step's sampled rows, padded, and a context bucket (a power of two of KV blocks). Steps with
prompt rows, weighted exits and shapes past the largest bucket run eagerly.

Per step the engine builds the step once (``StepBuilder``), writes its values into the
shape's host staging buffer (the layout: ``runtime_glue.engine.graph_buffers``), copies them
into the static device buffer with one copy (and the verify rows' kept states with another),
replays, and reads back the picks or the logits with one copy: a few host calls instead of
thousands of op launches (``runtime_glue.bench.graph_bench`` counts them).

Padding rows compute garbage of their own, never anyone else's: each writes its K/V to a
scratch slot in pages reserved in the pool (``BlockAllocator.reserve``: the same pages for every
engine on one pool), and reads only scratch pages.
A real row's table entries past its context repeat its first page; they are masked.

Padding changes the row count of every projection. In deterministic mode the plan's kernels
are row-invariant (checked at start-up), so each group's size is a power of two; in HF-exact
and fast modes a row count is part of the arithmetic, so every size has its own graph and no
row is padded.

Admitted on the device (:meth:`StepGraphRunner.admit`): one shape is captured on synthetic
rows in the scratch pages and replayed on other rows (other tokens, positions and exit rules);
the replay must give the logits and exit loops of the same step run eagerly, bit for bit.
Otherwise the engine runs every step eagerly and the plan says why.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch

from hal.graphs import StepGraph, StepGraphs, context_bucket
from hal.interfaces import Device
from runtime_glue.engine.graph_buffers import (
    GROUPS,
    Shape,
    StaticBuffers,
    sizes_up_to,
    stage,
    static_inputs,
)
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.request import Request
from runtime_glue.engine.step import HostStep, Scheduled, StepBuilder
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.model import OuroModel, StepOutput
from runtime_glue.ouro.plan import Admission

logger = logging.getLogger(__name__)


def group_limits(
    max_num_seqs: int, spec_tokens: int | None, depth: bool = False
) -> tuple[int, int, int, int]:
    """The most rows of each group (generated, draft, verify, depth) a step can hold (under
    depth-wise batching every generated row is a depth row)."""
    if depth:
        return (0, 0, 0, max_num_seqs)
    if spec_tokens is None:
        return (max_num_seqs, 0, 0, 0)
    return (max_num_seqs, max_num_seqs, max_num_seqs * (spec_tokens + 1), 0)


def scratch_blocks(limits: tuple[int, ...], block_size: int) -> int:
    """The KV blocks the padding rows of steps up to ``limits`` write to."""
    return -(-max(1, sum(limits) - 1) // block_size)


def picks_of(out: StepOutput) -> torch.Tensor:
    """The greedy picks and exit loops ``[2, R]``: what the engine reads back of a greedy step."""
    return torch.stack((out.logits.argmax(-1), out.chosen))


def packed_of(out: StepOutput) -> torch.Tensor:
    """The float32 logits with the exit loop appended ``[R, V + 1]``: what it reads back when
    it samples on the host or returns logits. A graph computes both forms; an eager step the
    one it needs."""
    return torch.cat((out.logits.float(), out.chosen[:, None].float()), 1)


@attrs.frozen(eq=False)
class Replayed:
    """A replayed step's outputs for its real sampled rows (device tensors, overwritten by the
    next replay: the engine reads them back, or clones what it keeps, before then)."""

    out: StepOutput
    picks: torch.Tensor | None  # None: an eager step, which computes the form it needs
    packed: torch.Tensor | None


class StepGraphRunner:
    """Captures decode-only steps lazily, one graph per :class:`Shape`, and replays them."""

    def __init__(
        self,
        graphs: StepGraphs,
        model: OuroModel,
        device: Device,
        allocator: BlockAllocator,
        builder: StepBuilder,
        limits: tuple[int, int, int, int],
        max_model_len: int,
    ) -> None:
        """``limits``: the most rows of each group a step can hold (generated, draft,
        verify, depth)."""
        self.graphs, self.model, self.device, self.builder = graphs, model, device, builder
        self.block_size = bs = allocator.block_size
        self.sizes = tuple(sizes_up_to(model.plan.mode, most) for most in limits)
        max_blocks = min(-(-max_model_len // bs), allocator.num_blocks)
        self.buckets = tuple(2**i for i in range(context_bucket(max_blocks).bit_length()))
        need = scratch_blocks(limits, bs)
        scratch = allocator.reserve(need)
        if scratch is None:
            raise ValueError(
                f"--step-graphs needs {need} scratch KV block(s) for padding rows, but the pool "
                f"has {allocator.num_free} free"
            )
        self.scratch = scratch
        # The cos/sin table for every position a request can reach, before any capture: a
        # graph keeps the table it saw, so it must never be reallocated afterwards.
        reach = min(max_model_len, allocator.num_blocks * bs)
        model.rope(torch.zeros(1, dtype=torch.int64, device=device.torch_device), reach)
        self._graphs: dict[Shape, tuple[StepGraph, StaticBuffers, Any]] = {}
        self.stats = {"graph_steps": 0, "eager_steps": 0, "captures": 0}

    @property
    def label(self) -> str:
        return self.graphs.label

    def shape_for(self, host: HostStep) -> Shape | None:
        """The captured shape a step runs in, or None if it must run eagerly."""
        if self.model.recorder is not None or not host.decode_only:
            return None
        if any(m.kind == "weighted" for m in host.modes):
            return None
        depth = host.groups["depth"]
        if depth and depth != host.num_rows:  # depth rows beside others: eagerly
            return None
        rows = []
        for group, sizes in zip(GROUPS, self.sizes, strict=True):
            n = host.groups[group]
            size = next((s for s in sizes if s >= n), None)
            if size is None:
                return None
            rows.append(size)
        meta = host.kv.base
        blocks = context_bucket(max(-(-(c + 1) // self.block_size) for c in meta.host_context_lens))
        if blocks > self.buckets[-1]:
            return None
        samples = None
        if depth:  # its sampled rows, padded as its rows are
            samples = next(s for s in self.sizes[3] if s >= len(host.sample_rows))
        return Shape((rows[0], rows[1], rows[2], rows[3]), blocks, samples)

    def run(self, host: HostStep) -> Replayed | None:
        """Replay the step's graph (real sampled rows only), or None: run it eagerly."""
        shape = self.shape_for(host)
        if shape is None:
            self.stats["eager_steps"] += 1
            return None
        with torch.inference_mode():
            values, real = stage(host, shape, self.scratch, self.block_size)
            entry = self._graphs.get(shape)
            if entry is None:
                entry = self._capture(shape, values, host)
            else:
                entry[1].load(values, host)
            graph, _, outputs = entry
            graph.replay()
        self.stats["graph_steps"] += 1
        return _real_rows(outputs, real)

    def _capture(self, shape: Shape, values: list[int], host: HostStep | None):
        tables = self.builder.kv.tables
        buf = StaticBuffers(shape, tables, self.model, self.device.torch_device,
                            self.device.pin_memory, self.builder.early,
                            self.builder.depth)  # fmt: skip
        buf.load(values, host)
        early = self.builder.early if shape.rows[1] + shape.rows[2] else None

        def step():  # plain tensors: what a graph's outputs are (an emulated one too)
            out = self.model.forward(static_inputs(self.model, buf, early))
            # A graph always computes them (any row may need them), unless it samples none.
            assert out.gates is not None or shape.samples == 0
            return out.logits, out.chosen, out.states, out.gates, picks_of(out), packed_of(out)

        graph, outputs = self.graphs.capture(step)
        self._graphs[shape] = entry = (graph, buf, outputs)
        self.stats["captures"] += 1
        logger.info("captured a %s for rows %s x %d blocks", self.label, shape.rows, shape.blocks)
        return entry

    def admit(self) -> Admission:
        """Capture one shape on synthetic rows (the scratch pages), replay it on other rows
        and compare with the same step run eagerly: admitted iff bit for bit equal."""
        bs, model = self.block_size, self.model
        offsets = [o for o in range(len(self.scratch) * bs) if o % bs]  # position 0: a prompt's
        store = self.builder.depth
        rows = max(s for s in self.sizes[0 if store is None else 3] if s <= len(offsets))
        gen = torch.Generator().manual_seed(rows)
        vocab, T = model.cfg.vocab_size, model.cfg.total_ut_steps
        modes = [ExitMode(), ExitMode(step=min(1, T - 1)), ExitMode(threshold=0.5), ExitMode()]
        made: list[Request] = []

        def synthetic(permute: bool) -> HostStep:
            ids = torch.randint(0, vocab, (rows,), generator=gen).tolist()
            at = offsets[:rows][:: -1 if permute else 1]  # every offset in the step
            plan = []
            for j in range(rows):
                if store is None:
                    mode = modes[j % len(modes)] if permute else ExitMode()
                    req = _decode_row(ids[j], at[j] % bs, self.scratch[at[j] // bs], mode)
                    plan.append(Scheduled(req=req, n=1))
                else:  # a token at every loop, each its own slot, the same loops and rules
                    loop = (rows - 1 - j if permute else j) % T  # in another order
                    mode = modes[loop % len(modes)]
                    req = _decode_row(ids[j], at[j] % bs, self.scratch[at[j] // bs], mode)
                    store.token(req).loop = loop
                    last = loop == T - 1  # a threshold row may leave where tokens may
                    leaves = store.exits and mode.kind == "threshold" and not last
                    plan.append(Scheduled(req=req, n=1, loop=loop, finishing=last,
                                          may_exit=leaves))  # fmt: skip
                made.append(req)
            return self.builder.build(plan)

        label = f"at {rows} {'depth-wise ' if store else ''}row(s) x 1 block"
        try:
            with torch.inference_mode():
                first = synthetic(False)
                shape = self.shape_for(first)
                assert shape is not None
                values, real = stage(first, shape, self.scratch, self.block_size)
                self._capture(shape, values, first)
                for req in made:
                    req.depth = None  # (their slots go to the trial's rows)
                trial = synthetic(True)
                eager = model.forward(trial.inputs(self.device.torch_device))
                replay = self.run(trial)
                assert replay is not None
                replayed = (replay.out.logits.clone(), replay.out.chosen.clone())
        except Exception as exc:  # noqa: BLE001 - any failure to capture or replay refuses it
            self._graphs.clear()
            return Admission("step_graphs", self.label, False,
                             f"{label}: cannot capture or replay here: {type(exc).__name__}: {exc}")  # fmt: skip
        finally:
            for req in made:
                req.depth = None  # their store slots are free again
        self.stats = {"graph_steps": 0, "eager_steps": 0, "captures": len(self._graphs)}
        same_logits = torch.equal(replayed[0], eager.logits)
        same_exits = torch.equal(replayed[1].to(eager.chosen.dtype), eager.chosen)
        if same_logits and same_exits:
            return Admission("step_graphs", self.label, True,
                             f"{label}: replay equals the eager step bit for bit (logits, exit "
                             "loops) on other tokens, positions and exit rules than captured",
                             0.0, 0.0)  # fmt: skip
        self._graphs.clear()
        diff = (replayed[0].float() - eager.logits.float()).abs().max().item()
        what = " and ".join(
            [f"logits (max difference {diff:.3g})"] * (not same_logits)
            + ["exit loops"] * (not same_exits)
        )
        return Admission("step_graphs", self.label, False,
                         f"{label}: replay differs from the eager step in its {what}; "
                         "every step runs eagerly", diff)  # fmt: skip


def _decode_row(token: int, position: int, page: int, mode: ExitMode) -> Request:
    """A synthetic request decoding ``token`` at ``position`` in ``page`` (admission)."""
    from runtime_glue.engine.sampling import SamplingParams

    req = Request("admission", [0], SamplingParams(max_tokens=position + 1))
    req.output_ids = [0] * (position - 1) + [token]  # position >= 1: a generated position
    req.num_computed = position
    req.blocks = [page]
    req.exit_mode = mode
    return req


def _real_rows(outputs, real: list[int]) -> Replayed:
    """The replayed step's outputs for its real rows (``real``: where they sit among the
    padded): a view when they lead, as in the common case (one group, padding after it)."""
    logits, chosen, states, gates, picks, packed = outputs
    n = len(real)
    if real == list(range(n)):

        def rows(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return x.narrow(dim, 0, n)

    else:
        idx = torch.tensor(real, dtype=torch.int64, device=logits.device)

        def rows(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return x.index_select(dim, idx)

    cut = StepOutput(
        logits=rows(logits),
        chosen=rows(chosen),
        states=rows(states, 1),
        gates=None if gates is None else rows(gates, 1),
    )
    return Replayed(out=cut, picks=rows(picks, 1), packed=rows(packed))
