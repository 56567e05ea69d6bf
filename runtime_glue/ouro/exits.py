"""Ouro's exit gate: which loop's state a token's logits are read from.

After loop ``t`` the model holds ``h_t = norm(hidden after loop t)`` (the state loop ``t + 1``
starts from) and the gate ``g_t = early_exit_gate(h_t)`` (``Linear(H, 1)`` with a bias). With
``l_t = sigmoid(g_t)``, the exit distribution over loops is

    p_t     = l_t * prod_{j<t} (1 - l_j)       for t < T - 1
    p_{T-1} = prod_{j<T-1} (1 - l_j)            (the remainder)

A token's logits come, in this order of precedence, from: ``exit_at_step = k``, loop ``k``;
``exit_threshold = q``, the first loop whose cumulative ``sum_{i<=t} p_i >= q`` (the last if
none); ``weighted_exit``, ``sum_t p_t * lm_head(h_t)`` (each weight cast to the logits' dtype,
summed in loop order); otherwise the last loop. A request's own choice wins; a request that
makes none gets the server's defaults (``--exit-at-step``, ``--exit-threshold``), else the
checkpoint's (``early_exit_step``, ``early_exit_threshold`` in config.json).

The arithmetic is the checkpoint's own code's: ``l``, ``p`` and the running remainder in the
gate's dtype (bf16), the threshold test on a ``cumsum`` in that dtype.
"""

from __future__ import annotations

import attrs
import torch

from runtime_glue.engine.sampling import SamplingParams


@attrs.frozen
class ExitMode:
    step: int | None = None
    threshold: float | None = None
    weighted: bool = False

    @property
    def kind(self) -> str:
        """ "step", "threshold", "weighted" or "last", by precedence."""
        if self.step is not None:
            return "step"
        if self.threshold is not None:
            return "threshold"
        return "weighted" if self.weighted else "last"

    @classmethod
    def of(cls, params: SamplingParams, defaults: ExitMode) -> ExitMode:
        own = cls(params.exit_at_step, params.exit_threshold, params.weighted_exit)
        return own if own.kind != "last" else defaults

    def describe(self) -> str:
        return {
            "step": f"exit at loop {self.step}",
            "threshold": f"exit threshold {self.threshold}",
            "weighted": "weighted exit",
            "last": "last loop",
        }[self.kind]


def exit_pdf(gates: torch.Tensor) -> torch.Tensor:
    """``gates [T, X]`` (one row of gate values per loop) -> the exit distribution ``[X, T]``."""
    steps = gates.shape[0]
    remaining = torch.ones_like(gates[0])
    pdf = []
    for t in range(steps):
        lam = torch.sigmoid(gates[t])
        if t < steps - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    return torch.stack(pdf, dim=-1)


def threshold_steps(pdf: torch.Tensor, threshold: float) -> torch.Tensor:
    """The exit loop of each row of ``pdf [X, T]`` under ``threshold`` (int64 ``[X]``), chosen
    on the device (``torch.where``, not a masked assignment that would read it back)."""
    reached = torch.cumsum(pdf, dim=-1) >= threshold
    first = torch.argmax(reached.float(), dim=-1)
    return torch.where(reached.any(dim=-1), first, pdf.shape[-1] - 1)
