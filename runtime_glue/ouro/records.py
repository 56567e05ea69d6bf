"""The values a step hands :meth:`runtime_glue.ouro.model.OuroModel.forward` and gets back.

Records, built by keyword: :class:`StepInputs` (one step's rows, as the engine's input
builder or a captured step graph's static buffers lay them out), its :class:`Span`\\ s (which
rows run which loops: always at least one) and :class:`Kept` states, and the
:class:`StepOutput` of its sampled rows.
"""

from __future__ import annotations

import attrs
import torch

from hal.types import KVAddressing
from runtime_glue.ouro.exits import ExitRule


@attrs.frozen(eq=False, kw_only=True)
class Span:
    """Rows of a step that run ``loops`` together. A plain step is one span, every row through
    every loop; a speculative step has two (``runtime_glue.engine.spans`` lays them out)."""

    loops: range
    rows: torch.Tensor  # [n] int64: the step's rows in this span, ascending
    kv: KVAddressing  # of those rows
    samples: torch.Tensor  # [m] int64: which sampled rows are among them, ascending ...
    sample_at: torch.Tensor  # [m] int64: ... and where within the span
    prompt_rows: int  # the span's first rows that are prompt positions
    whole: bool = False  # rows is every row of the step, in order (nothing to gather)


@attrs.frozen(eq=False, kw_only=True)
class Kept:
    """Rows that start after loop 0, from the states an earlier step kept (verify rows)."""

    rows: torch.Tensor  # [V] int64: their rows in the step
    samples: torch.Tensor  # [V] int64: their sampled-row indices
    states: torch.Tensor  # [V, E, H]: the state after each of loops 0 .. E-1
    gates: torch.Tensor | None  # [V, E]: the gate after each, when the step is gated


@attrs.frozen(eq=False, kw_only=True)
class DepthRows:
    """Depth-wise rows (``--depth-batching``, docs/depth-batching.md): generated rows that run
    one loop each in this step, whichever loop their token is at, all in the step's first span
    (its attention shifts each row to its own loop's planes). A row past loop 0 starts from its
    token's state after the loop before; each row's state (and gate) after its loop is written
    to its token's slot of the store (``runtime_glue.engine.depth_store``: ``states``,
    ``gates``, written in place). The sampled ones (at the last loop, or at a loop where they
    may exit under adaptive depth) read their token's loops so far from there, zeros after."""

    rows: torch.Tensor  # [D] int64: every depth row of the step, ascending
    slots: torch.Tensor  # [D] int64: each one's slot in the store
    loops: torch.Tensor  # [D] int64: the loop each runs now
    states: torch.Tensor  # [S, T, H]: the store's states
    gates: torch.Tensor  # [S, T]: and gates
    kept_rows: torch.Tensor  # [V] int64: the sampled depth rows (step rows) ...
    kept_samples: torch.Tensor  # [V] int64: ... their sampled-row indices ...
    kept_slots: torch.Tensor  # [V] int64: ... slots ...
    kept_loops: torch.Tensor  # [V] int64: ... and loops
    fills: bool = False  # some may leave after their loop: fill the planes they would skip


@attrs.frozen(eq=False, kw_only=True)
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
    spans: tuple[Span, ...] = attrs.field(validator=attrs.validators.min_len(1))
    kept: Kept | None = None
    depth: DepthRows | None = None
    modes: tuple = ()  # per sampled row, ExitMode (adaptive depth reads the thresholds)


@attrs.frozen(eq=False, kw_only=True)
class StepOutput:
    """What a step computed for its sampled rows, on the device."""

    logits: torch.Tensor  # [R, vocab]: the chosen loop's logits
    chosen: torch.Tensor  # [R] int64: the loop each row's logits came from
    states: torch.Tensor  # [T, R, H]: each sampled row's state after every loop
    gates: torch.Tensor | None  # [T, R]: its gate after every loop, when gated
