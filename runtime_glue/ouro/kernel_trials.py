"""Which kernel a deterministic plan gives each op (``runtime_glue.ouro.resolve``): every
usable kernel the driver offers (``_candidates``; see ``SLOWER``) is checked at the op's real
shape for a row's bits in every call shape (``hal.kernels.check_rows``, on adversarial
inputs), and of those that pass, the one whose worst ratio to the fastest over the timed row
counts is smallest is chosen (:func:`measure`). :func:`recheck` is the start-up check of a
recorded choice.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import attrs
import torch

from hal.interfaces import Driver
from hal.kernels import Kernel, adversarial_rows, adversarial_weight, check_rows
from hal.quant import (
    STATIC_REFERENCE,
    TOKEN_REFERENCE,
    QuantizedWeight,
    adversarial_qrows,
    adversarial_qweight,
    kernel_activations,
    scheme_of,
    with_static_input,
)
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.plan import (
    GENERATED_TILE,
    KINDS,
    OPS,
    PROMPT_TILE,
    SAMPLED_OPS,
    Measurement,
    OpChoice,
    hal_op,
    row_function,
    tile_sets,
)
from runtime_glue.ouro.plan_record import Recorded, now


class DeterminismUnavailable(RuntimeError):
    """No offered kernel keeps deterministic mode's guarantee for some op here."""


@attrs.define
class PlanOp:
    """One plan op of one model: its check inputs, its timing inputs, how to call a kernel."""

    name: str
    width: int  # the length of an input row
    weight: torch.Tensor | QuantizedWeight | None  # the model's real weight (linear ops only)
    eps: float
    device: torch.device
    _check_inputs: dict = attrs.field(factory=dict)

    def check_call(self, fn: Callable, rows: int) -> tuple[Callable, torch.Tensor]:
        """``(apply, x)`` for ``hal.kernels.check_rows``: adversarial inputs, ``rows`` rows."""
        gen = torch.Generator().manual_seed(rows * 7919 + self.width)
        if self.weight is None:
            x = torch.randn(rows, self.width, generator=gen) * 3
            x[:, :: max(1, self.width // 5)] *= 64.0  # large squares among small ones
            return self.bind(fn, None), x.bfloat16().to(self.device)
        w = self.weight
        if "w" not in self._check_inputs:  # one weight per op: it is the costly part
            n, k = w.shape
            if isinstance(w, QuantizedWeight):
                qw = adversarial_qweight(n, k, w.scheme, w.group_size, gen)
                if w.static is not None:  # W8A8 static: the model's calibrated input
                    st = w.static
                    qw = with_static_input(qw, float(st.scale[0]), int(st.offset[0]))
                self._check_inputs["w"] = qw.to(self.device)
            else:
                self._check_inputs["w"] = adversarial_weight(n, k, gen).to(self.device)
        if rows not in self._check_inputs:
            if isinstance(w, QuantizedWeight):
                x = adversarial_qrows(rows, self.width, w.scheme, gen)
            else:
                x = adversarial_rows(rows, self.width, gen)
            self._check_inputs[rows] = x.to(self.device)
        return self.bind(fn, self._check_inputs["w"]), self._check_inputs[rows]

    def timing_call(self, fn: Callable, rows: int) -> Callable[[], object]:
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, self.width, generator=gen).bfloat16().to(self.device)
        apply = self.bind(fn, self.weight)
        return lambda: apply(x)

    @property
    def scheme(self) -> str:
        return scheme_of(self.weight)

    def bind(self, fn: Callable, weight) -> Callable:
        """``fn`` called the way the model calls this op, on rows ``x``."""
        if self.name == "rms_norm":
            norm_w = torch.full((self.width,), 1.25, dtype=torch.bfloat16, device=self.device)
            return lambda x: fn(x, norm_w, self.eps)
        if self.name == "silu_mul":
            return fn
        return lambda x: fn(x, weight)


def linear_weights(weights: dict) -> dict:
    """Each linear plan op's weight (layer 0's: every layer's has its shape and scheme)."""
    p = "model.layers.0."
    return {
        "qkv_proj": weights[p + "self_attn.qkv_proj.weight"],
        "o_proj": weights[p + "self_attn.o_proj.weight"],
        "gate_up_proj": weights[p + "mlp.gate_up_proj.weight"],
        "down_proj": weights[p + "mlp.down_proj.weight"],
        "lm_head": weights["lm_head.weight"],
        "exit_gate": weights["model.early_exit_gate.weight"],
    }


def op_schemes(weights: dict) -> dict[str, str]:
    """Each op's weight scheme ("bf16" for ops without weights)."""
    schemes = {op: scheme_of(w) for op, w in linear_weights(weights).items()}
    return {op: schemes.get(op, "bf16") for op in OPS}


def model_ops(cfg: OuroConfig, weights: dict, device) -> dict[str, PlanOp]:
    linear = linear_weights(weights)
    eps = cfg.rms_norm_eps
    ops = {op: PlanOp(op, w.shape[1], w, eps, device) for op, w in linear.items()}
    ops["rms_norm"] = PlanOp("rms_norm", cfg.hidden_size, None, eps, device)
    ops["silu_mul"] = PlanOp("silu_mul", 2 * cfg.intermediate_size, None, eps, device)
    return ops


def _tile_max(kind: str, op: str) -> int:
    return GENERATED_TILE if kind == "generated" or op in SAMPLED_OPS else PROMPT_TILE


def _timing_rows(kind: str, op: str) -> tuple[int, ...]:
    """Decode row counts for generated and sampled rows; prefill ones for prompt rows."""
    return (1, 8) if kind == "generated" or op in SAMPLED_OPS else (64, 256)


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    times = []
    for _ in range(3 if time.perf_counter() - start > 0.005 else 7):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@attrs.frozen
class _Trial:
    """What one kernel did for one (op, largest tile): the tiles it passed, its timings."""

    tiles: tuple[int, ...] | None  # None: failed every tile set
    why: str = ""
    seconds: tuple[tuple[int, float], ...] = ()


def _try_kernel(op: PlanOp, kernel: Kernel, largest: int, rows, sync) -> _Trial:
    failures = []
    for tiles in tile_sets(largest):
        fn = row_function(op.name, kernel, tiles)
        apply, x = op.check_call(fn, 2 * largest)
        why = check_rows(apply, x, tiles)
        if why is None:
            timed = [(r, _median_seconds(op.timing_call(fn, r), sync)) for r in rows]
            return _Trial(tiles, seconds=tuple(timed))
        failures.append(f"tiles {tiles[0]}..{tiles[-1]}: {why}")
    return _Trial(None, "; ".join(failures))


def _best(trials: dict[str, _Trial]) -> str:
    """The kernel whose worst ratio to the fastest, over the timed row counts, is smallest."""
    timed = {k: dict(t.seconds) for k, t in trials.items() if t.tiles is not None}
    if len(timed) == 1:
        return next(iter(timed))
    rows = next(iter(timed.values())).keys()
    fastest = {r: min(s[r] for s in timed.values()) for r in rows}
    worst = {k: max(s[r] / fastest[r] for r in rows) for k, s in timed.items()}
    return min(timed, key=lambda k: (worst[k], sum(timed[k].values())))


def named_for(driver: Driver, linear: str | None, scheme: str) -> str | None:
    """The linear kernel ``--linear`` names for weights in ``scheme``: it, where it takes them
    (else None: the plan chooses; a bf16 kernel named does not bind quantized projections)."""
    if linear is None or driver.kernel("linear", linear).scheme != scheme:
        return None
    return linear


def plain_linear(
    driver: Driver, linear: str | None, scheme: str, activations: str | None = None
) -> str:
    """The linear kernel of a plan that measures nothing (HF-exact, fast) for weights in
    ``scheme``: the one ``--linear`` names where it takes them, else the reference (torch's
    F.linear; for quantized weights, F.linear on them dequantized: ``hal.quant``; with
    per-token or static activations, the driver's own kernel of that arithmetic, else the
    reference, ``hal.quant.token_linear`` or ``static_linear``: the same bits)."""
    named = named_for(driver, linear, scheme)
    if named is not None:
        return named
    if scheme == "bf16":
        return "torch"
    if activations not in ("token", "static"):
        return f"{scheme}-dequant"
    kind, reference = {
        "token": ("int8-token", TOKEN_REFERENCE),
        "static": ("int8-static", STATIC_REFERENCE),
    }[activations]
    own = (
        k.name
        for k in driver.kernels_for("linear", scheme)
        if k.activations == kind
        and not k.fast_only
        and k.name != reference
        and k.available() is None
    )
    return next(own, reference)


def _candidates(
    driver: Driver, op: str, linear: str | None, scheme: str, activations: str | None = None
) -> tuple[list[Kernel], list[str]]:
    """The kernels a plan may give ``op`` (weights in ``scheme``), and why others cannot run.
    A quantized projection's kernels by how they take their activations
    (``Kernel.activations``, ``hal.quant.kernel_activations``): as given, or quantized
    where ``activations`` (``--quantize-activations``) says so."""
    usable: list[Kernel] = []
    notes: list[str] = []
    named = named_for(driver, linear, scheme) if hal_op(op) == "linear" else None
    for kernel in driver.kernels_for(hal_op(op), scheme):
        if named is not None and kernel.name != named:
            continue
        if kernel.fast_only:  # admitted by --mode fast's own check, never chosen here
            continue
        if kernel.scheme != "bf16" and kernel.activations not in kernel_activations(activations):
            continue
        why = kernel.available()
        if why is None:
            usable.append(kernel)
        else:
            notes.append(f"{kernel.op} {kernel.name} cannot run here: {why}")
    return usable, notes


def measure(
    driver: Driver, ops: dict[str, PlanOp], linear: str | None, activations: str | None = None
) -> Recorded:
    """Each op's kernel for each row kind: of those that pass the start-up check, the fastest
    by ``_best``, timed here and now."""
    chosen: dict[str, dict[str, OpChoice]] = {kind: {} for kind in KINDS}
    measured: list[Measurement] = []
    notes: list[str] = []
    for kind in KINDS:
        for op in OPS:
            kernels, skipped = _candidates(driver, op, linear, ops[op].scheme, activations)
            notes += [n for n in skipped if n not in notes]
            trials = _trials(ops[op], kind, kernels, driver.device.synchronize)
            passed = {k: t for k, t in trials.items() if t.tiles is not None}
            if not passed:
                tried = "; ".join(f"{k}: {t.why}" for k, t in trials.items()) or "none usable"
                raise DeterminismUnavailable(
                    f"no kernel gives {op} {_shape(ops[op])} a row's bits in every call shape "
                    f"({tried})"
                )
            best = _best(passed)
            chosen[kind][op] = OpChoice(best, passed[best].tiles or ())
            for name, t in passed.items():
                measured += [Measurement(op, kind, name, r, s) for r, s in t.seconds]
    return Recorded(chosen, tuple(measured), tuple(notes), now())


def fastest(
    driver: Driver,
    ops: dict[str, PlanOp],
    linear: str | None,
    fixed: dict[str, str],
    activations: str | None = None,
) -> tuple[dict[str, dict[str, OpChoice]], tuple[Measurement, ...]]:
    """Fast mode's kernel for each op and row kind: the fastest usable one at the op's real
    shape, timed at the kind's row counts, with no row check (fast mode keeps no bits).
    ``fixed``: ops whose kernel is decided already (a fused kernel admitted on the device)."""
    chosen: dict[str, dict[str, OpChoice]] = {kind: {} for kind in KINDS}
    measured: list[Measurement] = []
    sync = driver.device.synchronize
    for kind in KINDS:
        for op in OPS:
            if op in fixed:
                chosen[kind][op] = OpChoice(fixed[op])
                continue
            kernels, skipped = _candidates(driver, op, linear, ops[op].scheme, activations)
            if not kernels:
                raise ValueError(f"no kernel for {op} can run here: {'; '.join(skipped)}")
            timed = {
                k.name: _Trial(
                    (),
                    seconds=tuple(
                        (r, _median_seconds(ops[op].timing_call(row_function(op, k, ()), r), sync))
                        for r in _timing_rows(kind, op)
                    ),
                )
                for k in kernels
                if len(kernels) > 1
            }
            chosen[kind][op] = OpChoice(_best(timed) if timed else kernels[0].name)
            measured += [
                Measurement(op, kind, name, r, sec)
                for name, t in timed.items()
                for r, sec in t.seconds
            ]
    return chosen, tuple(measured)


SLOWER = 3.0  # a kernel this many times slower than the fastest at first is not tried further


def _trials(op: PlanOp, kind: str, kernels: list[Kernel], sync) -> dict[str, _Trial]:
    """A trial of each kernel for ``op`` on ``kind`` rows.

    Kernels more than ``SLOWER`` times slower than the fastest at the first timed row count
    are tried only if none of the others passes the check.
    """
    largest = _tile_max(kind, op.name)
    rows = _timing_rows(kind, op.name)
    first: dict[str, float] = {}
    if len(kernels) > 1:
        for k in kernels:
            fn = row_function(op.name, k, tile_sets(largest)[0])
            first[k.name] = _median_seconds(op.timing_call(fn, rows[0]), sync)
    fastest = min(first.values(), default=0.0)
    order = sorted(kernels, key=lambda k: first.get(k.name, 0.0) > SLOWER * fastest)
    trials: dict[str, _Trial] = {}
    for k in order:
        if first.get(k.name, 0.0) > SLOWER * fastest and any(t.tiles for t in trials.values()):
            continue
        trials[k.name] = _try_kernel(op, k, largest, rows, sync)
    return trials


def _shape(op: PlanOp) -> str:
    return str(list(op.weight.shape)) if op.weight is not None else f"[rows, {op.width}]"


def recheck(chosen, ops: dict[str, PlanOp], driver: Driver) -> str | None:
    """The start-up check of recorded choices: None if every one still passes, else what
    failed (a library or kernel that changed under the record)."""
    for kind, choices in chosen.items():
        for op, c in choices.items():
            try:
                kernel = driver.kernel(hal_op(op), c.kernel)
            except ValueError as exc:
                return f"{op}: {exc}"
            if kernel.available() is not None:
                return f"{op} {c.kernel} cannot run here: {kernel.available()}"
            apply, x = ops[op].check_call(row_function(op, kernel, c.tiles), 2 * c.tiles[-1])
            why = check_rows(apply, x, c.tiles)
            if why is not None:
                return f"{op} {_shape(ops[op])} with {c.kernel} ({kind} rows): {why}"
    return None
