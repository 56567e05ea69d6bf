"""Resolving the execution plan (``runtime_glue.ouro.plan``): the start-up checks and the timings.

Where several kernels pass, :func:`resolve` times them at the op's real shapes and row counts
(prefill rows for the prompt kind, decode rows for the generated kind) and keeps the one
whose worst ratio to the fastest is smallest. The choice is recorded per machine, model shape
and plan flags (``runtime_glue.ouro.plan_record``) and reused by every later engine: timings
move with the machine's load, and a request's bits must not. The start-up check is never
recorded: a recorded choice that fails it is measured again, and the plan says so.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import attrs
import torch

from hal.eager import TensorKVStore
from hal.interfaces import AttentionBackend, Driver
from hal.kernels import Kernel, adversarial_rows, adversarial_weight, check_rows
from hal.types import AttentionMetadata, KVLayout
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.plan import (
    GENERATED_TILE,
    KINDS,
    LINEAR_OPS,
    OPS,
    PROMPT_TILE,
    SAMPLED_OPS,
    ExecutionPlan,
    Measurement,
    OpChoice,
    hal_op,
    row_function,
    tile_sets,
)
from runtime_glue.ouro.plan_record import PlanRecord, Recorded, now

logger = logging.getLogger(__name__)


class DeterminismUnavailable(RuntimeError):
    """No offered kernel keeps deterministic mode's guarantee for some op here."""


@attrs.define
class _Op:
    """One plan op of one model: its check inputs, its timing inputs, how to call a kernel."""

    name: str
    width: int  # the length of an input row
    weight: torch.Tensor | None  # the model's real weight (linear ops only)
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
        if "w" not in self._check_inputs:  # one weight per op: it is the costly part
            n, k = self.weight.shape
            self._check_inputs["w"] = adversarial_weight(n, k, gen).to(self.device)
        if rows not in self._check_inputs:
            self._check_inputs[rows] = adversarial_rows(rows, self.width, gen).to(self.device)
        return self.bind(fn, self._check_inputs["w"]), self._check_inputs[rows]

    def timing_call(self, fn: Callable, rows: int) -> Callable[[], object]:
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, self.width, generator=gen).bfloat16().to(self.device)
        apply = self.bind(fn, self.weight)
        return lambda: apply(x)

    def bind(self, fn: Callable, weight: torch.Tensor | None) -> Callable:
        """``fn`` called the way the model calls this op, on rows ``x``."""
        if self.name == "rms_norm":
            norm_w = torch.full((self.width,), 1.25, dtype=torch.bfloat16, device=self.device)
            return lambda x: fn(x, norm_w, self.eps)
        if self.name == "silu_mul":
            return fn
        return lambda x: fn(x, weight)


def _model_ops(cfg: OuroConfig, weights: dict[str, torch.Tensor], device) -> dict[str, _Op]:
    p = "model.layers.0."
    linear = {
        "qkv_proj": weights[p + "self_attn.qkv_proj.weight"],
        "o_proj": weights[p + "self_attn.o_proj.weight"],
        "gate_up_proj": weights[p + "mlp.gate_up_proj.weight"],
        "down_proj": weights[p + "mlp.down_proj.weight"],
        "lm_head": weights["lm_head.weight"],
        "exit_gate": weights["model.early_exit_gate.weight"],
    }
    eps = cfg.rms_norm_eps
    ops = {op: _Op(op, w.shape[1], w, eps, device) for op, w in linear.items()}
    ops["rms_norm"] = _Op("rms_norm", cfg.hidden_size, None, eps, device)
    ops["silu_mul"] = _Op("silu_mul", 2 * cfg.intermediate_size, None, eps, device)
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


def _try_kernel(op: _Op, kernel: Kernel, largest: int, rows, sync) -> _Trial:
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


def check_attention(backend: AttentionBackend, cfg: OuroConfig, device) -> str | None:
    """None if the backend's deterministic mode gives each query row the same bits alone, in
    a chunk, and beside another request, for this model's heads; else what differed.

    A row's work depends on its own position only, by construction (its context length is the
    only size that varies); this runs it once in each call form the engine issues.
    """
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(d)
    kv = TensorKVStore(KVLayout(1, 8, 16, kv_heads, d), device)
    k = (torch.randn(kv.layout.num_slots, kv_heads, d, generator=gen) * 2).bfloat16()
    v = torch.randn(k.shape, generator=gen).bfloat16()
    kv.write(0, k.to(device), v.to(device), torch.arange(kv.layout.num_slots, device=device))
    q = (torch.randn(1, heads, 20, d, generator=gen) * 2).bfloat16().to(device)
    pages, other = [3, 6, 1], [7, 0, 5]  # 17 tokens in cache, rows at positions 17..36

    def run(requests):  # (first query row, rows, context_len, block ids) per request
        meta = AttentionMetadata.build(16, [(n, c, b) for _, n, c, b in requests])
        queries = torch.cat([q[:, :, first : first + n] for first, n, _, _ in requests], 2)
        meta = meta.to(device)[0]
        return backend.forward(queries, 0, kv, meta, d**-0.5, deterministic=True)

    chunk = run([(0, 20, 17, pages)])
    for i in (0, 7, 19):
        mine = (i, 1, 17 + i, pages)
        if not torch.equal(run([mine]), chunk[i : i + 1]):
            return f"{backend.name}: a row computed alone differs from the same row in a chunk"
        if not torch.equal(run([(3, 2, 40, other), mine])[2:], chunk[i : i + 1]):
            return f"{backend.name}: a row beside another request differs from the row alone"
    return None


def resolve(
    driver: Driver,
    cfg: OuroConfig,
    weights: dict[str, torch.Tensor],
    attention: str | None = None,
    deterministic: bool | None = None,
    linear: str | None = None,
    exit_at_step: int | None = None,
    exit_threshold: float | None = None,
    adaptive_depth: bool = False,
    mode: str | None = None,
    block_size: int = 128,
    remeasure: bool = False,
) -> ExecutionPlan:
    """The plan for this model on this driver.

    ``mode``: "fast" (fused kernels, each admitted by a check on the device at this model's
    shapes and the KV ``block_size``: ``runtime_glue.ouro.admission``), "deterministic" or
    "hf-exact" (``deterministic`` True or False: the older spelling of the same choice).

    ``deterministic``: True, the mode or an error; False, HF-exact (or fast, with a ``linear``
    that is not HF-exact); None, the backend's default (the mode where the backend measured it
    cheap; off, logged, where it cannot be kept). ``linear`` names one projection kernel for
    every projection; by default the fastest that keeps the mode. ``exit_at_step`` and
    ``exit_threshold`` are the exit defaults of requests that choose none (else the
    checkpoint's); ``adaptive_depth`` lets exiting decode rows skip their remaining loops.
    ``remeasure``: time the kernels again and record the new choice instead of reusing the
    one recorded for this machine, shape and flags (``runtime_glue.ouro.plan_record``).
    """
    exits = _exit_defaults(cfg, exit_at_step, exit_threshold)
    deterministic = mode_to_deterministic(mode, deterministic)
    if mode == "fast":
        from runtime_glue.ouro.admission import fast_plan

        plan = fast_plan(driver, cfg, weights, attention, linear, block_size)
    else:
        plan = _resolve_kernels(driver, cfg, weights, attention, deterministic, linear, remeasure)
    return attrs.evolve(
        plan,
        exit_defaults=exits,
        adaptive_depth=adaptive_depth,
    )


MODES = ("fast", "deterministic", "hf-exact")


def mode_to_deterministic(mode: str | None, deterministic: bool | None) -> bool | None:
    """``--mode`` against ``--[no-]deterministic`` (its aliases): the one choice they make."""
    if mode is None:
        return deterministic
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    implied = {"deterministic": True, "hf-exact": False, "fast": None}[mode]
    if deterministic is not None and deterministic != implied:
        flag = "--deterministic" if deterministic else "--no-deterministic"
        raise ValueError(f"--mode {mode} contradicts {flag} (an alias of another mode)")
    return bool(implied)


def _exit_defaults(cfg: OuroConfig, step: int | None, threshold: float | None) -> ExitMode:
    if step is not None and not 0 <= step < cfg.total_ut_steps:
        raise ValueError(f"exit_at_step must be in [0, {cfg.total_ut_steps}), got {step}")
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"exit_threshold must be in (0, 1], got {threshold}")
    if step is not None or threshold is not None:
        return ExitMode(step, threshold)
    return ExitMode(cfg.early_exit_step, cfg.early_exit_threshold)


def _resolve_kernels(
    driver, cfg, weights, attention, deterministic, linear, remeasure
) -> ExecutionPlan:
    backend = driver.backend(attention)
    if linear is not None:
        kernel = driver.kernel("linear", linear)
        kernel.check()  # named explicitly: cannot run here is an error, not a fallback
    want = deterministic
    if want is None:
        want = backend.supports_deterministic and backend.deterministic_by_default
    if not want:
        return _exact_plan(driver, backend, linear)
    if not backend.supports_deterministic:
        raise ValueError(f"attention backend {backend.name!r} does not support deterministic mode")
    try:
        return _deterministic_plan(driver, backend, cfg, weights, linear, remeasure)
    except DeterminismUnavailable as exc:
        if deterministic:
            raise
        logger.warning("deterministic mode is off by default here: %s", exc)
        plan = _exact_plan(driver, backend, linear)
        return attrs.evolve(plan, notes=(f"deterministic mode is off: {exc}",))


def _exact_plan(driver: Driver, backend: AttentionBackend, linear: str | None) -> ExecutionPlan:
    name = linear or "torch"
    exact = driver.kernel("linear", name).hf_exact and backend.hf_exact
    ops = tuple((op, OpChoice(name if op in LINEAR_OPS else "torch")) for op in OPS)
    mode = "hf-exact" if exact else "fast"
    return ExecutionPlan(mode, backend.name, stacked=not exact, prompt=ops, generated=ops)


def _candidates(driver: Driver, op: str, linear: str | None) -> tuple[list[Kernel], list[str]]:
    usable: list[Kernel] = []
    notes: list[str] = []
    for kernel in driver.kernels_for(hal_op(op)):
        if hal_op(op) == "linear" and linear is not None and kernel.name != linear:
            continue
        if kernel.fast_only:  # admitted by --mode fast's own check, never chosen here
            continue
        why = kernel.available()
        if why is None:
            usable.append(kernel)
        else:
            notes.append(f"{kernel.op} {kernel.name} cannot run here: {why}")
    return usable, notes


# The first words of the note that says where a deterministic plan's kernel choice is kept.
RECORDED_IN = "kernels as recorded in "
MEASURED_NOW = "kernels measured now ("


def record_note(plan: ExecutionPlan) -> str | None:
    """Where the plan's kernel choice is recorded, and whether it was measured now or reused
    (None for a plan that keeps no record: HF-exact, fast)."""
    return next((n for n in plan.notes if n.startswith((RECORDED_IN, MEASURED_NOW))), None)


def _deterministic_plan(driver, backend, cfg, weights, linear, remeasure) -> ExecutionPlan:
    """The recorded choice for this machine, shape and flags if it still passes the start-up
    check; else (or with ``remeasure``) a choice measured now, and recorded."""
    device = driver.device.torch_device
    why = check_attention(backend, cfg, device)
    if why is not None:
        raise DeterminismUnavailable(why)
    ops = _model_ops(cfg, weights, device)
    record = PlanRecord(driver, cfg, backend.name, linear)
    with record.locked():
        recorded = None if remeasure else record.load()
        if recorded is not None:
            stale = _recheck(recorded.chosen, ops, driver)  # never a recorded verdict
            if stale is None:
                note = f"{RECORDED_IN}{record.path} ({recorded.when})"
                return _plan(backend, recorded, (*recorded.notes, note))
            logger.warning(
                "the recorded plan failed its start-up check, measuring again: %s", stale
            )
            why = f"the choice recorded in {record.path} failed its start-up check ({stale})"
        else:
            why = "asked to (--remeasure-plan)" if remeasure else "none recorded"
        recorded = _measure(driver, ops, linear)
        record.save(recorded)
    note = f"{MEASURED_NOW}{why}; {recorded.when}) and recorded in {record.path}"
    return _plan(backend, recorded, (*recorded.notes, note))


def _plan(backend, recorded: Recorded, notes: tuple[str, ...]) -> ExecutionPlan:
    return ExecutionPlan(
        "deterministic",
        backend.name,
        stacked=True,
        prompt=tuple(recorded.chosen["prompt"].items()),
        generated=tuple(recorded.chosen["generated"].items()),
        measurements=recorded.measurements,
        notes=notes,
    )


def _measure(driver: Driver, ops: dict[str, _Op], linear: str | None) -> Recorded:
    """Each op's kernel for each row kind: of those that pass the start-up check, the fastest
    by ``_best``, timed here and now."""
    chosen: dict[str, dict[str, OpChoice]] = {kind: {} for kind in KINDS}
    measured: list[Measurement] = []
    notes: list[str] = []
    for kind in KINDS:
        for op in OPS:
            kernels, skipped = _candidates(driver, op, linear)
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


SLOWER = 3.0  # a kernel this many times slower than the fastest at first is not tried further


def _trials(op: _Op, kind: str, kernels: list[Kernel], sync) -> dict[str, _Trial]:
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


def _shape(op: _Op) -> str:
    return str(list(op.weight.shape)) if op.weight is not None else f"[rows, {op.width}]"


def _recheck(chosen, ops: dict[str, _Op], driver: Driver) -> str | None:
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
