"""Deterministic mode: a row's bits depend on its own request only.

Two sources of row-to-row coupling exist in a step. Attention: a query inside a multi-row
call takes a different kernel path than the same query alone; the backends' deterministic
mode computes every row alone over exactly its own context. Linear layers: a one-row call
takes a different kernel path (gemv) than the same row inside a larger call, so one-row
calls are padded to two rows. Whether the kernels are then really row-invariant is a
property of the device and its libraries, so ``check_row_invariance`` verifies it for the
model's actual weight shapes before the mode is allowed to run.

Contract: with the mode on, tokens and logits do not depend on chunk size or on batch
composition. They may differ from HF's own bits for a lone request, since HF's prefill runs
multi-row attention; with the mode off, a lone request matches HF bit for bit instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_COUNTS = (1, 2, 3, 5, 8, 13, 16)


def padded(linear):
    """``linear`` that never makes a one-row call (one-row calls take the gemv path)."""

    def padded_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return linear(x.expand(2, -1), w)[:1]
        return linear(x, w)

    padded_linear.pads = linear  # type: ignore[attr-defined]
    return padded_linear


def choose_linear(weights: list[torch.Tensor], norm, allow_padding: bool = True, base=None):
    """The cheapest row-invariant form of the ``base`` kernel for these weight shapes.

    ``base`` (default ``F.linear``) itself when it is already row-invariant (padding would
    double the cost of one-row decode calls), else its padded variant if allowed;
    RuntimeError when neither is, or when ``norm`` is not.
    """
    x = _inputs(weights[0].shape[1], weights[0])
    check_rows(norm, x, "rms_norm")
    failure = None
    base = base or F.linear
    for linear in (base, padded(base))[: 2 if allow_padding else 1]:
        try:
            check_row_invariance(weights, linear)
            return linear
        except RuntimeError as exc:
            failure = failure or exc
    raise failure  # type: ignore[misc]


def check_row_invariance(weights: list[torch.Tensor], linear) -> None:
    """Raise RuntimeError unless every row of a call equals that row in calls of other sizes."""
    for shape in sorted({tuple(w.shape) for w in weights}):
        w = next(w for w in weights if tuple(w.shape) == shape)
        check_rows(lambda rows, w=w: linear(rows, w), _inputs(shape[1], w), f"linear {list(shape)}")


def _inputs(width: int, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(width)
    return torch.randn(max(ROW_COUNTS), width, generator=gen).to(like.dtype).to(like.device)


def check_rows(fn, x: torch.Tensor, what: str) -> None:
    """Raise RuntimeError unless ``fn`` gives each row of ``x`` (16+ rows) the same bits in
    calls of every size in ROW_COUNTS."""
    full = fn(x)
    for n in ROW_COUNTS:
        for start in (0, len(x) - n):
            part = fn(x[start : start + n])
            if not torch.equal(part, full[start : start + n]):
                raise RuntimeError(
                    f"deterministic mode is not supported on this device: {what} gives "
                    f"different bits for the same row in calls of {n} and {len(x)} rows"
                )
