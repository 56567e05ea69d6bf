"""Resolving the execution plan (``runtime_glue.ouro.plan``): the start-up checks and the timings.

Where several kernels pass, :func:`resolve` times them at the op's real shapes and row counts
(prefill rows for the prompt kind, decode rows for the generated kind) and keeps the one
whose worst ratio to the fastest is smallest (``runtime_glue.ouro.kernel_trials``). The
choice is recorded per machine, model shape and plan flags (``runtime_glue.ouro.plan_record``)
and reused by every later engine: timings move with the machine's load, and a request's bits
must not. The start-up check is never recorded: a recorded choice that fails it is measured
again, and the plan says so.
"""

from __future__ import annotations

import logging

import attrs
import torch

from hal.eager import TensorKVStore
from hal.interfaces import AttentionBackend, Driver
from hal.quant import kernel_activations
from hal.types import AttentionMetadata, KVLayout
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.kernel_trials import (
    DeterminismUnavailable,
    measure,
    model_ops,
    op_schemes,
    plain_linear,
    recheck,
)
from runtime_glue.ouro.plan import LINEAR_OPS, OPS, ExecutionPlan, OpChoice, exact_rotary
from runtime_glue.ouro.plan_record import PlanRecord, Recorded
from runtime_glue.ouro.quantize import weights_label

logger = logging.getLogger(__name__)


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
    activations: str | None = None,
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
    ``activations``: how quantized projections may take their activations
    (``--quantize-activations``: None as given; "block" also per block of 32; "token" per
    token, always; ``hal.quant.kernel_activations``).
    """
    exits = _exit_defaults(cfg, exit_at_step, exit_threshold)
    deterministic = mode_to_deterministic(mode, deterministic)
    schemes = op_schemes(weights)
    if linear is not None:
        named = driver.kernel("linear", linear)
        scheme = named.scheme
        allowed = kernel_activations(activations)
        if named.scheme != "bf16" and named.activations not in allowed:
            mode = {"int8": "block", "int8-token": "token", "int8-static": "static"}.get(
                named.activations
            )
            raise ValueError(
                f"--linear {linear} "
                + (f"quantizes its activations ({named.description}): add "
                   f"--quantize-activations {mode}" if mode else
                   f"takes its activations as given, and --quantize-activations {activations} "
                   "quantizes every projection's")
            )  # fmt: skip
        if scheme not in ("bf16", *schemes.values()):
            raise ValueError(
                f"--linear {linear} takes {scheme} weights, and this model's projections are "
                f"{' and '.join(sorted(set(schemes.values())))}"
            )
    if mode == "fast":
        from runtime_glue.ouro.admission import fast_plan

        plan = fast_plan(driver, cfg, weights, attention, linear, block_size, activations)
    else:
        plan = _resolve_kernels(
            driver, cfg, weights, attention, deterministic, linear, remeasure, activations
        )
    return attrs.evolve(
        plan,
        exit_defaults=exits,
        adaptive_depth=adaptive_depth,
        quantization=weights_label(weights, activations),
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
    driver, cfg, weights, attention, deterministic, linear, remeasure, activations
) -> ExecutionPlan:
    backend = driver.backend(attention)
    if linear is not None:
        kernel = driver.kernel("linear", linear)
        kernel.check()  # named explicitly: cannot run here is an error, not a fallback
    want = deterministic
    if want is None:
        want = backend.supports_deterministic and backend.deterministic_by_default
    if not want:
        return _exact_plan(driver, backend, linear, op_schemes(weights), activations)
    try:
        return _deterministic_plan(driver, backend, cfg, weights, linear, remeasure, activations)
    except DeterminismUnavailable as exc:
        if deterministic:
            raise
        logger.warning("deterministic mode is off by default here: %s", exc)
        plan = _exact_plan(driver, backend, linear, op_schemes(weights), activations)
        return attrs.evolve(plan, notes=(f"deterministic mode is off: {exc}",))


def _exact_plan(
    driver: Driver,
    backend: AttentionBackend,
    linear: str | None,
    schemes: dict[str, str],
    activations: str | None = None,
) -> ExecutionPlan:
    names = {op: plain_linear(driver, linear, schemes[op], activations) for op in LINEAR_OPS}
    exact = backend.hf_exact and all(driver.kernel("linear", n).hf_exact for n in names.values())
    ops = tuple((op, OpChoice(names.get(op, "torch"))) for op in OPS)
    mode = "hf-exact" if exact else "fast"
    return ExecutionPlan(mode, backend.name, stacked=not exact, prompt=ops, generated=ops)


# The first words of the note that says where a deterministic plan's kernel choice is kept.
RECORDED_IN = "kernels as recorded in "
MEASURED_NOW = "kernels measured now ("


def record_note(plan: ExecutionPlan) -> str | None:
    """Where the plan's kernel choice is recorded, and whether it was measured now or reused
    (None for a plan that keeps no record: HF-exact, fast)."""
    return next((n for n in plan.notes if n.startswith((RECORDED_IN, MEASURED_NOW))), None)


def _deterministic_plan(
    driver, backend, cfg, weights, linear, remeasure, activations
) -> ExecutionPlan:
    """The recorded choice for this machine, shape and flags if it still passes the start-up
    check; else (or with ``remeasure``) a choice measured now, and recorded."""
    device = driver.device.torch_device
    why = check_attention(backend, cfg, device)
    if why is not None:
        raise DeterminismUnavailable(why)
    ops = model_ops(cfg, weights, device)
    label = weights_label(weights, activations)
    record = PlanRecord(driver, cfg, backend.name, linear, label)
    with record.locked():
        recorded = None if remeasure else record.load()
        if recorded is not None:
            stale = recheck(recorded.chosen, ops, driver)  # never a recorded verdict
            if stale is None:
                note = f"{RECORDED_IN}{record.path} ({recorded.when})"
                return _plan(driver, backend, recorded, (*recorded.notes, note))
            logger.warning(
                "the recorded plan failed its start-up check, measuring again: %s", stale
            )
            why = f"the choice recorded in {record.path} failed its start-up check ({stale})"
        else:
            why = "asked to (--remeasure-plan)" if remeasure else "none recorded"
        recorded = measure(driver, ops, linear, activations)
        record.save(recorded)
    note = f"{MEASURED_NOW}{why}; {recorded.when}) and recorded in {record.path}"
    return _plan(driver, backend, recorded, (*recorded.notes, note))


def _plan(driver, backend, recorded: Recorded, notes: tuple[str, ...]) -> ExecutionPlan:
    rotary = exact_rotary(driver)
    return ExecutionPlan(
        "deterministic",
        backend.name,
        stacked=True,
        prompt=tuple(recorded.chosen["prompt"].items()),
        generated=tuple(recorded.chosen["generated"].items()),
        measurements=recorded.measurements,
        notes=notes,
        fused=(("rotary", rotary),) if rotary else (),
    )
