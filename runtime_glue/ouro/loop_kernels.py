"""The plan's kernels as the one layer body calls them (``OuroModel.loop``).

:class:`LoopKernels` is built once from the execution plan: every op's row function for each
row kind (``runtime_glue.ouro.plan``), and two ops only a fused plan runs as kernels of their
own, each a residual add with the norm after it and the rotary embedding. The fast plan
passes the driver's fused kernels (each admitted on the device first:
``runtime_glue.ouro.admission``); a deterministic plan may pass a driver's rotary kernel with
HF's bits (``plan.exact_rotary``); otherwise a plan passes compositions of its own kernels that
give exactly the bits of Hugging Face's modules:

    add_rms_norm(x, h, w) = (rms_norm(h + x, w), h + x)    # the plan's rms_norm, per row kind
    rotary(q, k)          = x * cos + rotate_half(x) * sin  # bf16, in HF's [1, heads, N, d]

:class:`RowOps` binds them to one call's split of rows into prompt and generated positions.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from hal.interfaces import Driver
from hal.kernels import rotate_half
from runtime_glue.ouro.plan import KINDS, OPS, ExecutionPlan, hal_op, row_function


def hf_rotary(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` on ``q [N, Hq, d]``, ``k [N, Hkv, d]``, in HF's layout:
    the arithmetic is elementwise, but the result's layout is what attention's matmuls get."""
    cos, sin = cos[None, None], sin[None, None]  # [1, 1, N, d]
    q, k = q[None].transpose(1, 2), k[None].transpose(1, 2)  # [1, heads, N, d]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q[0].transpose(0, 1), k[0].transpose(0, 1)  # [N, heads, d]


def add_then_norm(rows: RowOps, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's residual add ``h = h + x``, then the plan's own ``rms_norm`` of the sum."""
    total = residual + x
    return rows("rms_norm", total, weight, eps), total


def on_every_row(kernel: Callable) -> Callable:
    """A fused ``add_rms_norm`` kernel, called once on every row of the call, of either kind."""

    def call(rows: RowOps, x, residual, weight, eps):
        return kernel(x, residual, weight, eps)

    return call


@attrs.frozen(eq=False, kw_only=True)
class LoopKernels:
    """Every kernel one loop calls, as the plan chose them."""

    rows: dict[str, dict[str, Callable]]  # row kind -> plan op -> row function
    split: bool  # prompt and generated rows run different kernels
    stacked: bool  # one projection on q|k|v and on gate|up
    silu_mul: Callable  # silu(gate) * up on separate tensors, as HF calls it (not stacked)
    add_rms_norm: Callable  # (rows, x, residual, weight, eps) -> (normed, residual + x)
    rotary: Callable  # (q [N, Hq, d], k [N, Hkv, d], cos [N, d], sin [N, d]) -> (q', k')
    # A decode-only step attends in its static form (hal.graphs), so that its bits do not
    # depend on whether it was replayed: the fast plan, where the driver offers step graphs
    # (on cpu, which has none, the backend's own decode attention is faster).
    static_decode: bool

    @classmethod
    def from_plan(cls, plan: ExecutionPlan, driver: Driver) -> LoopKernels:
        rows = {
            kind: {
                op: row_function(op, driver.kernel(hal_op(op), c.kernel), c.tiles)
                for op in OPS
                for c in (plan.choice(kind, op),)
            }
            for kind in KINDS
        }
        silu_mul = driver.kernel("silu_mul", plan.choice("prompt", "silu_mul").kernel).fn
        fused = dict(plan.fused)  # the driver's kernels of these ops, where the plan runs one
        add_rms_norm, rotary = add_then_norm, hf_rotary
        # Without a fused kernel (torch's), the add then the plan's own norm: HF's composition
        # where the plan's norm is torch's, and the faster norm where it is not (fast mode on
        # a driver with no fused add_rms_norm, e.g. cpu).
        if fused.get("add_rms_norm", "torch") != "torch":
            add_rms_norm = on_every_row(driver.kernel("add_rms_norm", fused["add_rms_norm"]).fn)
        if "rotary" in fused:
            rotary = driver.kernel("rotary", fused["rotary"]).fn
        return cls(
            rows=rows,
            split=plan.split,
            stacked=plan.stacked,
            silu_mul=silu_mul,
            add_rms_norm=add_rms_norm,
            rotary=rotary,
            static_decode=plan.mode == "fast" and driver.offers_step_graphs,
        )

    def bind(self, prompt_rows: int) -> RowOps:
        """The kernels for calls on rows whose first ``prompt_rows`` are prompt positions."""
        return RowOps(self, prompt_rows if self.split else None)


class RowOps:
    """The plan's kernels bound for one call's split of rows into prompt and generated."""

    def __init__(self, kernels: LoopKernels, split: int | None) -> None:
        self.kernels = kernels
        self.split = split  # None: both kinds run the same kernels

    def __call__(self, op: str, x: torch.Tensor, *consts) -> torch.Tensor:
        """``op`` on rows ``x`` (and constant arguments), each row by its kind's kernel."""
        p, kernels = self.split, self.kernels.rows
        if p is None or p == x.shape[0]:
            return kernels["prompt"][op](x, *consts)
        if p == 0:
            return kernels["generated"][op](x, *consts)
        return torch.cat(
            (kernels["prompt"][op](x[:p], *consts), kernels["generated"][op](x[p:], *consts))
        )

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``."""
        return self.kernels.add_rms_norm(self, x, residual, weight, eps)

    def rotary(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rotary(q, k, cos, sin)
