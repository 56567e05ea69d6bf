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

import struct

import attrs
import torch


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

    def or_default(self, default: ExitMode) -> ExitMode:
        """This mode where it chooses an exit, else ``default`` (a request's own choice wins)."""
        return self if self.kind != "last" else default

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


def bf16_bits(x: float) -> int:
    """The bfloat16 bit pattern torch gives a Python float (via float32, nearest even): how a
    threshold travels to the device with a step's other integers."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@attrs.frozen(eq=False, kw_only=True)
class ExitRule:
    """Each sampled row's exit rule as device tensors, the same in an eager step and in a
    replayed step graph (the exit loop chosen on the device: :meth:`loops`).

    ``step``: the fixed loop (the last loop for rows that choose none, and for threshold rows
    when no gate is needed); ``use_threshold`` and ``threshold`` (bf16 bits, compared in bf16
    as the checkpoint's code compares a Python float with its bf16 ``cumsum``). On the host:
    ``weighted``, the sampled rows with a weighted exit (eager steps only), and ``gated``,
    whether any row needs the gate."""

    step: torch.Tensor  # [R] int64
    use_threshold: torch.Tensor  # [R] int64, 0 or 1
    threshold: torch.Tensor  # [R] int64: bf16 bits
    weighted: tuple[int, ...] = ()
    gated: bool = False

    @staticmethod
    def host_values(modes, loops: int) -> tuple[list[int], list[int], list[int]]:
        """The three per-row columns of ``modes`` (``ExitMode`` each) as host integers."""
        step = [m.step if m.step is not None else loops - 1 for m in modes]
        use = [int(m.kind == "threshold") for m in modes]
        bits = [bf16_bits(m.threshold) if m.kind == "threshold" else 0 for m in modes]
        return step, use, bits

    def loops(self, pdf: torch.Tensor | None) -> torch.Tensor:
        """The loop each row's logits are read from ``[R]``; ``pdf [R, T]`` when gated."""
        if pdf is None:
            return self.step
        threshold = self.threshold.to(torch.int16).view(torch.bfloat16).to(pdf.dtype)
        reached = torch.cumsum(pdf, dim=-1) >= threshold[:, None]
        first = torch.argmax(reached.float(), dim=-1)
        by_threshold = torch.where(reached.any(dim=-1), first, pdf.shape[-1] - 1)
        return torch.where(self.use_threshold.bool(), by_threshold, self.step)
