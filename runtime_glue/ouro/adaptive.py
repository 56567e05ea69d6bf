"""Adaptive depth (``--adaptive-depth``), for one step of ``runtime_glue.ouro.model``.

A decode row whose cumulative exit probability reaches its threshold after loop ``t`` leaves
the batch, and its later loops are not run. The planes of the loops it skipped still need
its K/V, which later tokens attend to: they get the K/V of its last computed loop at the same
layer, copied from its loop-``t`` slot to its slot of every later loop (``KVAddressing``:
under kv sharing a generated block has one slot for every loop, and the copy changes
nothing). This approximates the checkpoint's own arithmetic, which runs every loop
(docs/benchmarks.md measures how often tokens still agree). Deciding who leaves reads the exit
test back from the device once per loop.
"""

from __future__ import annotations

import torch

from hal.types import KVAddressing


def fill_skipped_planes(model, kv: KVAddressing, row: int, t: int) -> None:
    """Row ``row``'s loop-``t`` K/V into its slots of every later loop, at every layer (``kv``:
    the row's addressing as a plain step has it). Adaptive depth's fill (depth-wise batching
    fills inside its step: ``OuroModel._depth_fill``)."""
    src = kv.write_slots(t)[row : row + 1]
    for later in range(t + 1, model.cfg.total_ut_steps):
        dst = kv.write_slots(later)[row : row + 1]
        for li in range(model.cfg.num_hidden_layers):
            k, v = model.kv.gather(li, src)  # [1, kv_heads, 1, d]
            model.kv.write(li, k[0].transpose(0, 1), v[0].transpose(0, 1), dst)


class Adaptive:
    def __init__(self, model, step, exits: dict[int, float]) -> None:
        self.model, self.step, self.exits = model, step, exits
        self.batch = list(range(step.input_ids.shape[0]))  # original row of each batch row
        self.remaining: dict[int, torch.Tensor | None] = dict.fromkeys(exits)  # prod (1 - lambda)
        self.cumulative: dict[int, torch.Tensor] = {}
        self.exited: dict[int, tuple[int, torch.Tensor]] = {}  # sampled row -> (loop, h_t)
        self.original = step.kv  # every row's addressing, for the copies

    @classmethod
    def start(cls, model, step) -> Adaptive | None:
        """Only decode rows (one row of a generated position, sampled) in threshold mode; None
        when the step has none. A step of several spans (speculation) is refused, as
        ``runtime_glue.engine.args.REFUSED`` refuses the pair: never full depth, silently."""
        if len(step.spans) > 1:
            raise RuntimeError(
                "adaptive depth cannot run a step of several spans: --speculative-loops cannot "
                "be combined with --adaptive-depth (runtime_glue.engine.args.REFUSED)"
            )
        meta = step.kv.base
        one_row = {meta.request(q)[0] for q in range(meta.num_requests) if meta.request(q)[1] == 1}
        exits = {
            r: m.threshold
            for r, m in enumerate(step.modes)
            if m.kind == "threshold"
            and r >= step.prompt_samples
            and step.host_sample_rows[r] in one_row
        }
        return cls(model, step, exits) if exits else None

    def after_loop(self, t: int, h, cos, sin, kv: KVAddressing):
        """Test the rows still in the batch after loop ``t``; drop those that exit."""
        leaving = [r for r in self._still_in() if self._reached(r, t, h)]
        if not leaving:
            return h, cos, sin, kv
        for r in leaving:
            position = self.batch.index(self.step.host_sample_rows[r])
            self.exited[r] = (t, h[position : position + 1])
            self._fill_skipped_planes(t, self.step.host_sample_rows[r])
        gone = {self.step.host_sample_rows[r] for r in leaving}
        keep = [i for i, row in enumerate(self.batch) if row not in gone]
        starts = kv.base.host_query_start_loc
        requests = [q for q in range(kv.base.num_requests) if self.batch[starts[q]] not in gone]
        self.batch = [self.batch[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.int64, device=h.device)
        return h.index_select(0, index), cos[:, index], sin[:, index], kv.select(requests)

    def _still_in(self) -> list[int]:
        return [r for r in self.exits if r not in self.exited]

    def _reached(self, r: int, t: int, h: torch.Tensor) -> bool:
        position = self.batch.index(self.step.host_sample_rows[r])
        gate_fn = self.model.kernels.rows["generated"]["exit_gate"]
        g = gate_fn(h[position : position + 1], self.model.gate_weight) + self.model.gate_bias
        lam = torch.sigmoid(g[0])  # [1], the same shape for every row
        remaining = self.remaining[r]
        p = lam if remaining is None else lam * remaining
        self.remaining[r] = (1.0 - lam) if remaining is None else remaining * (1.0 - lam)
        self.cumulative[r] = p if r not in self.cumulative else self.cumulative[r] + p
        return bool(self.cumulative[r] >= self.exits[r])  # a read of the device, per loop

    def _fill_skipped_planes(self, t: int, row: int) -> None:
        fill_skipped_planes(self.model, self.original, row, t)

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
