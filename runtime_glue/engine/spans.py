"""Which rows of a step run which loops: the one layout of a step's spans.

The input builder (``runtime_glue.engine.step``) and a captured step graph's static buffers
(``runtime_glue.engine.graph_buffers``) both read it, so an eager step and its replay cannot
lay out the same rows differently. Rows are ordered prompt | generated | draft | verify.

- A plain step is one span: every row through every loop.
- A step with drafts or verifies (speculation, ``early`` = E draft loops) has two: the prompt
  and generated rows run loops 0 .. E-1 with the drafts, then E .. T-1 with the verifies,
  which start from the states their drafts kept (``StepLayout.kept``).
- A step with depth-wise rows (``--depth-batching``; after the others) has two, or one when
  it holds nothing else: every row runs one pass over the layers (loop 0, where a depth row's
  attention is shifted to its own loop's planes), then the prompt and generated rows run
  loops 1 .. T-1. Depth rows at the last loop (or, under adaptive depth, at a loop they may
  leave after) are sampled (``StepLayout.kept``: their earlier loops' states are read from the
  depth store, ``runtime_glue.engine.depth_store``).

Every index list is ascending, a span's rows and its samples alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs


@attrs.frozen(kw_only=True)
class SpanLayout:
    """One span, as host indices (``runtime_glue.ouro.records.Span`` holds them on the device)."""

    loops: range
    rows: tuple[int, ...]  # the step's rows in the span
    entries: tuple[int, ...]  # their entries of the step's attention metadata
    samples: tuple[int, ...]  # which sampled rows are among them ...
    sample_at: tuple[int, ...]  # ... and where each sits within the span


@attrs.frozen(kw_only=True)
class StepLayout:
    spans: tuple[SpanLayout, ...]  # at least one
    kept: tuple[int, ...]  # verify rows (their drafts' kept states), or sampled depth rows ...
    kept_samples: tuple[int, ...]  # ... and their sampled-row indices


def step_layout(
    rows: Mapping[str, int],
    entries: Mapping[str, int],
    sample_rows: Sequence[int],
    loops: int,
    early: int | None,
) -> StepLayout:
    """The spans of a step with ``rows`` (and attention ``entries``) per group: prompt,
    generated, draft, verify; ``sample_rows``: its sampled rows; ``loops``: T; ``early``: E
    when speculation is on (a step without drafts or verifies is still a plain one)."""
    normal = rows["prompt"] + rows["generated"]
    if rows.get("depth", 0):
        return _depth_layout(rows, entries, sample_rows, loops)
    n = normal + rows["draft"] + rows["verify"]
    if early is None or n == normal:
        every = _span(range(loops), range(n), range(sum(entries.values())), sample_rows)
        return StepLayout(spans=(every,), kept=(), kept_samples=())
    drafts = range(normal, normal + rows["draft"])
    verifies = range(normal + rows["draft"], n)
    e_normal = entries["prompt"] + entries["generated"]
    e_drafts = e_normal + entries["draft"]
    e_all = e_drafts + entries["verify"]
    first = _span(range(early), [*range(normal), *drafts], range(e_drafts), sample_rows)
    second = _span(
        range(early, loops),
        [*range(normal), *verifies],
        [*range(e_normal), *range(e_drafts, e_all)],
        sample_rows,
    )
    kept_samples = tuple(i for i, row in enumerate(sample_rows) if row in verifies)
    return StepLayout(spans=(first, second), kept=tuple(verifies), kept_samples=kept_samples)


def _depth_layout(rows, entries, sample_rows: Sequence[int], loops: int) -> StepLayout:
    """Depth rows (every one through loop 0's pass, its own loop by its addressing) after the
    prompt and generated rows (every loop: that pass, then loops 1 .. T-1)."""
    normal = rows["prompt"] + rows["generated"]
    n, e_normal = normal + rows["depth"], entries["prompt"] + entries["generated"]
    plain = range(normal)
    first = _span(range(1), range(n), range(e_normal + entries["depth"]), sample_rows, plain)
    spans: tuple[SpanLayout, ...] = (first,)
    if normal:
        spans += (_span(range(1, loops), plain, range(e_normal), sample_rows),)
    finishing = tuple(i for i, row in enumerate(sample_rows) if row >= normal)
    return StepLayout(
        spans=spans, kept=tuple(sample_rows[i] for i in finishing), kept_samples=finishing
    )


def _span(
    loops: range,
    rows: Sequence[int],
    entries: Sequence[int],
    sample_rows,
    sampling: Sequence[int] | None = None,
) -> SpanLayout:
    """``sampling``: the rows whose samples the span files (default: all of its rows)."""
    at = {row: i for i, row in enumerate(rows)}
    filed = at if sampling is None else {row: at[row] for row in sampling}
    samples = tuple(i for i, row in enumerate(sample_rows) if row in filed)
    return SpanLayout(
        loops=loops,
        rows=tuple(rows),
        entries=tuple(entries),
        samples=samples,
        sample_at=tuple(at[sample_rows[i]] for i in samples),
    )
