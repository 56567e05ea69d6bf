"""``OuroModel.loop`` on decode-sized calls with every kernel bound once (``Kernel.into``).

A generated row's layer pass calls a dozen kernels, each through the plan's row function,
its row tiles and the kernel's wrapper (checks, an output allocated per call). On the cpu
driver that host work was about a quarter of an int4 decode step on ouro-1.4b-shape
(docs/benchmarks.md). :class:`BoundLoop` runs the same kernels, chosen by the same plan, with
the same operands and row counts, in the same order: each projection and norm bound to its
weight when the model is built, writing into buffers it owns; views of those buffers made
once per row count. So a row's bits are the per-op path's, whatever the kernels' claims:

- an op with row tiles runs on the smallest tile that holds the rows, its input's extra rows
  zero (as ``plan.row_tiled`` pads them); an op without tiles on the rows themselves;
- the residual adds are torch's bf16 adds, in place on the loop's own residual buffer;
- what has no bound form here (the plan's torch ``silu_mul``, a torch rotary) runs its row
  function on the same rows, as ``OuroModel.loop`` calls it; the K/V write and attention
  go through the backend, as there.

It runs a call only where ``OuroModel.loop`` would call every op on one row kind's kernels
(``RowOps.split``), for 1 to ``GENERATED_TILE`` rows, with no recorder or profiler
listening (both want each op's tensor or name). It is built where the plan stacks q|k|v and
gate|up, adds each residual plainly (no fused ``add_rms_norm``) and some kernel of it has a
bound form (an op whose kernel has none, e.g. torch's, runs its row function on the call's
rows), and only once each bound kernel has given its row function's bits on a row of this
model's weights (``check``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import attrs
import torch

from runtime_glue.ouro.loop_kernels import RowOps, add_then_norm
from runtime_glue.ouro.plan import GENERATED_TILE, hal_op

logger = logging.getLogger(__name__)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
WEIGHTS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


class Unbound(Exception):
    """Why the model keeps the per-op path (said once, at build)."""


@attrs.frozen
class OpRows:
    """The row counts the plan issues an op's calls on (``plan.row_tiled``)."""

    tiles: tuple[int, ...]

    def rows(self, n: int) -> int:
        return next(t for t in self.tiles if t >= n) if self.tiles else n


class Views:
    """A row count's views of the buffers, made once per row count: each call's output, its
    input rows (the op's tile of them) and the input's extra rows (zeroed before the call)."""

    # call site -> (op whose row tiles it takes, output buffer, input buffer)
    SITES = {
        "first": ("rms_norm", "x", "h"),
        "qkv_proj": ("qkv_proj", "qkv", "x"),
        "o_proj": ("o_proj", "a", "o"),
        "ln_2": ("rms_norm", "a2", "a"),
        "post_ln": ("rms_norm", "x", "h"),
        "gate_up_proj": ("gate_up_proj", "gate_up", "x"),
        "silu_mul": ("silu_mul", "act", "gate_up"),
        "down_proj": ("down_proj", "m", "act"),
        "post_ln_2": ("rms_norm", "a2", "m"),
        "after": ("rms_norm", "x", "h"),
    }

    def __init__(self, b: dict[str, torch.Tensor], n: int, ops: dict[str, OpRows], cfg):
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = b["qkv"][:n]
        self.q = qkv[:, : heads * d].view(n, heads, d)
        self.k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
        self.v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        self.rot = (b["qo"][:n], b["ko"][:n])  # rotary's outputs [n, heads, d]
        self.query = self.rot[0].transpose(0, 1)[None]  # attention's [1, heads, n, d]
        self.o, self.h, self.a2 = b["o"][:n], b["h"][:n], b["a2"][:n]
        self.gate_up, self.act = b["gate_up"][:n], b["act"][:n]
        self.calls: dict[str, tuple] = {}
        for site, (op, out, src) in self.SITES.items():
            m = ops[op].rows(n)
            self.calls[site] = (b[out], b[src][:m], b[src][n:m] if m > n else None)


class BoundLoop:
    """``OuroModel.loop`` for calls of up to ``max_rows`` rows of one kind."""

    def __init__(self, model, kind: str, ops: dict[str, OpRows], layers, first, silu, rotary):
        self.model, self.kind, self.ops, self.layers = model, kind, ops, layers
        self.split = 0 if kind == "generated" else None  # RowOps.split of such calls
        self.first = first  # layer 0's input norm
        self.silu_call = silu
        self.rotary_call = rotary  # None: the plan's rotary function
        tiled = [b.tiles[-1] for b in ops.values() if b.tiles]
        self.max_rows = min([GENERATED_TILE, *tiled])
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._views: dict[int, Views] = {}

    @classmethod
    def build(cls, model, driver) -> BoundLoop:
        """The bound loop of ``model``'s plan on ``driver``, or :class:`Unbound` saying why."""
        plan, k = model.plan, model.kernels
        if not k.stacked:
            raise Unbound("the plan runs q, k, v and gate, up unstacked (HF-exact)")
        if k.add_rms_norm is not add_then_norm:
            raise Unbound("the plan runs a fused add_rms_norm")
        kind = "generated" if plan.split else "prompt"
        ops, into, bound_any = {}, {}, False
        for op in (*PROJECTIONS, "rms_norm", "silu_mul"):
            choice = plan.choice(kind, op)
            kernel = driver.kernel(hal_op(op), choice.kernel)
            if kernel.into is not None:
                ops[op], into[op] = OpRows(choice.tiles), kernel.into
                bound_any = True
            else:  # its row function, which cuts its own tiles, on the call's own rows
                ops[op], into[op] = OpRows(()), partial(by_row_function, k.rows[kind][op])
        if not bound_any:  # e.g. cuda and npu, whose step graphs cut the host work instead
            raise Unbound("no kernel of the plan has a bound form (Kernel.into)")
        eps, norm, layers = model.cfg.rms_norm_eps, into["rms_norm"], []
        for li, w in enumerate(model.layers):
            after = model.layers[li + 1].ln if li + 1 < len(model.layers) else model.norm
            bound = {op: into[op](getattr(w, WEIGHTS[op])) for op in PROJECTIONS}
            for name, weight in (("ln_2", w.ln_2), ("post_ln", w.post_ln)):
                bound[name] = norm(weight, eps)
            bound["post_ln_2"], bound["after"] = norm(w.post_ln_2, eps), norm(after, eps)
            layers.append(bound)
        rotary = dict(plan.fused).get("rotary")
        rotary_into = driver.kernel("rotary", rotary).into if rotary else None
        bound_loop = cls(
            model, kind, ops, layers, norm(model.layers[0].ln, eps), into["silu_mul"](),
            rotary_into() if rotary_into is not None else None,
        )  # fmt: skip
        bound_loop.check()
        return bound_loop

    def runs(self, n: int, rows: RowOps) -> bool:
        """Whether this loop runs a call of ``n`` rows bound as ``rows`` (else per op)."""
        return (
            0 < n <= self.max_rows
            and rows.split == self.split
            and self.model.recorder is None
            and not torch.autograd.profiler._is_profiler_enabled
        )

    def check(self) -> None:
        """Each bound kernel against its row function, on one row of every layer-0 weight:
        Unbound where a bit differs (a driver's bound form that does not match its kernel)."""
        gen = torch.Generator().manual_seed(0)
        rows, eps = self.model.kernels.rows[self.kind], self.model.cfg.rms_norm_eps
        w, bound = self.model.layers[0], self.layers[0]
        for op in PROJECTIONS:
            weight = getattr(w, WEIGHTS[op])
            k = weight.in_features if hasattr(weight, "in_features") else weight.shape[1]
            _same(op, bound[op], rows[op], _row(k, gen), weight)
        _same("rms_norm", bound["ln_2"], rows["rms_norm"], _row(w.ln_2.shape[0], gen), w.ln_2, eps)
        gate_up = _row(2 * self.model.cfg.intermediate_size, gen)
        _same("silu_mul", self.silu_call, rows["silu_mul"], gate_up)
        if self.rotary_call is not None:
            cfg = self.model.cfg
            q = _row(cfg.num_attention_heads * cfg.head_dim, gen).view(1, -1, cfg.head_dim)
            k = _row(cfg.num_key_value_heads * cfg.head_dim, gen).view(1, -1, cfg.head_dim)
            cos, sin = (_row(cfg.head_dim, gen) for _ in range(2))
            want = self.model.kernels.rotary(q, k, cos, sin)
            got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
            self.rotary_call(got, q, k, cos, sin)
            if not all(map(torch.equal, got, want)):
                raise Unbound("rotary's bound kernel differs from the plan's rotary")

    def _views_for(self, n: int) -> Views:
        views = self._views.get(n)
        if views is None:
            cfg = self.model.cfg
            h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
            heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
            m = max(b.rows(n) for b in self.ops.values())
            m = 1 << (m - 1).bit_length()  # one set of buffers for every n up to a power of 2
            if m not in self._buffers:
                shapes = {
                    "x": (m, h), "h": (m, h), "qkv": (m, (heads + 2 * kvh) * d),
                    "qo": (m, heads, d), "ko": (m, kvh, d), "o": (m, heads * d),
                    "a": (m, h), "a2": (m, h), "gate_up": (m, 2 * i), "act": (m, i), "m": (m, h),
                }  # fmt: skip
                like = self.model.embed  # the model's dtype and device
                self._buffers[m] = {
                    k: torch.zeros(s, dtype=like.dtype, device=like.device)
                    for k, s in shapes.items()
                }
            views = self._views[n] = Views(self._buffers[m], n, self.ops, cfg)
        return views

    def loop(self, t: int, h, cos, sin, kv) -> torch.Tensor:
        """``OuroModel.loop(t, h, cos, sin, kv, rows)``'s result, for ``runs`` calls."""
        model, n = self.model, h.shape[0]
        v = self._views_for(n)
        calls = v.calls
        attention = model.backend.bind(
            model.kv, kv.meta(t), model.scaling, model.attend_deterministic
        )
        cos, sin = cos[0], sin[0]
        v.h.copy_(h)
        _run(self.first, *calls["first"])
        for li, bound in enumerate(self.layers):
            _run(bound["qkv_proj"], *calls["qkv_proj"])
            if self.rotary_call is not None:
                self.rotary_call(v.rot, v.q, v.k, cos, sin)
                k, query = v.rot[1], v.query
            else:
                q, k = model.kernels.rotary(v.q, v.k, cos, sin)
                query = q.transpose(0, 1)[None]
            plane = kv.plane(t, li)
            attention.write(plane, k, v.v)
            attention.attend(query, plane, v.o)
            _run(bound["o_proj"], *calls["o_proj"])
            _run(bound["ln_2"], *calls["ln_2"])
            v.h.add_(v.a2)
            _run(bound["post_ln"], *calls["post_ln"])
            _run(bound["gate_up_proj"], *calls["gate_up_proj"])
            _run(self.silu_call, *calls["silu_mul"])
            _run(bound["down_proj"], *calls["down_proj"])
            _run(bound["post_ln_2"], *calls["post_ln_2"])
            v.h.add_(v.a2)
            if li + 1 < len(self.layers):
                _run(bound["after"], *calls["after"])
        # The loop's state: a fresh tensor, as the per-op path returns it.
        x = v.h.new_empty(self.ops["rms_norm"].rows(n), v.h.shape[1])
        _run(self.layers[-1]["after"], x, *calls["after"][1:])
        return x[:n]


def bound_loop(model, driver) -> BoundLoop | None:
    """``model``'s bound loop, or None (every call per op) where it cannot be built."""
    try:
        return BoundLoop.build(model, driver)
    except Unbound as exc:
        logger.debug("every layer pass runs per op: %s", exc)
        return None


def by_row_function(fn: Callable, *consts) -> Callable:
    """The bound form of an op whose kernel has none: ``fn`` (its row function, which cuts
    its own row tiles as the per-op path does) on the call's rows, copied into ``out``."""

    def call(out: torch.Tensor, x: torch.Tensor) -> None:
        y = fn(x, *consts)
        out[: y.shape[0]].copy_(y)

    return call


def _run(call: Callable, out: torch.Tensor, x: torch.Tensor, pad: torch.Tensor | None) -> None:
    """``call(out, x)``, the extra rows ``pad`` of ``x`` (beyond the call's rows) zeroed first,
    as ``plan.row_tiled`` pads them."""
    if pad is not None:
        pad.zero_()
    call(out, x)


def _row(k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(1, k, generator=gen).to(torch.bfloat16)


def _same(op: str, call: Callable, row_function: Callable, x: torch.Tensor, *consts) -> None:
    want = row_function(x, *consts)
    got = torch.empty_like(want)
    call(got, x)
    if not torch.equal(got, want):
        raise Unbound(f"{op}'s bound kernel differs from its row function on this model's weights")
