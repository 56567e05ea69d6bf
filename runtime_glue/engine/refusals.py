"""What an engine cannot be built with: one declaration, one check, one place it runs.

Every engine is built by ``LLM._build`` (``LLM(...)``, ``LLM.variant``, ``LLM.with_speculation``,
the server, the benches), and it calls :func:`check_engine` first with the options the engine
actually runs with (``EngineArgs``, after a variant's or a speculation pair's changes). Nothing
else refuses a combination, and nothing turns a feature off on its own: an option asked for
either runs or is refused here with its reason. (Where the user asked for nothing, "auto"
choices consult :func:`why_not` and say in the plan's notes what they left off.)

The declaration has three parts:

- ``REFUSED``: pairs of options that do not combine, each with its arithmetic reason (declared
  with the options, ``runtime_glue.engine.args``);
- ``CAPABILITIES``: what an option needs of the driver or the attention backend (and a
  quantization scheme, a driver that runs it);
- ``BOUNDS``: the ranges of options that depend on the model or another option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hal.interfaces import AttentionBackend, Driver
from runtime_glue.engine.args import COMBINED_BY, REFUSED, SET
from runtime_glue.ouro.quantize import check_quantization

MAX_SPECULATIVE_TOKENS = 63  # a verify step's rows fit one generated-row tile (64)
DEFAULT_SPECULATIVE_TOKENS = 4


def _graphs_offered(driver: Driver, backend: AttentionBackend) -> str | None:
    if driver.step_graphs() is None:
        return (
            f"driver {driver.name!r} offers no step graphs (cuda and npu do; on cpu every op "
            "is already a host call)"
        )
    return None


def _graph_safe(driver: Driver, backend: AttentionBackend) -> str | None:
    if not backend.step_graphs:
        return (
            f"attention backend {backend.name!r} has no graph-safe decode form "
            "(hal.graphs.StaticDecodeMetadata); choose an *_eager backend"
        )
    return None


def _serves_deterministic(driver: Driver, backend: AttentionBackend) -> str | None:
    if not backend.supports_deterministic:
        return f"attention backend {backend.name!r} does not support deterministic mode"
    return None


Capability = Callable[[Driver, AttentionBackend], "str | None"]

# What an option asks of the driver and its attention backend: (option, value, check).
CAPABILITIES: tuple[tuple[str, Any, Capability], ...] = (
    ("step_graphs", True, _graphs_offered),
    ("step_graphs", True, _graph_safe),
    ("deterministic", True, _serves_deterministic),
    ("mode", "deterministic", _serves_deterministic),
)


def _speculation(args: Any, cfg: Any) -> str | None:
    """Speculation's loops and tokens: their range depends on the model and on each other."""
    total_loops = cfg.total_ut_steps
    loops, tokens = args.speculative_loops, args.num_speculative_tokens
    if tokens is not None and loops is None:
        return "num_speculative_tokens needs speculative_loops (--speculative-loops E)"
    if loops is not None and not 1 <= loops <= total_loops - 1:
        return (
            f"speculative_loops must be in [1, {total_loops - 1}] (the model runs "
            f"{total_loops} loops; the draft needs at least one, the verify step too), "
            f"got {loops}"
        )
    if tokens is not None and not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
        return f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {tokens}"
    k = DEFAULT_SPECULATIVE_TOKENS if tokens is None else tokens
    if loops is not None and k >= args.max_num_batched_tokens:
        return (
            f"num_speculative_tokens ({k}) must be below max_num_batched_tokens "
            f"({args.max_num_batched_tokens}): a verify step computes num_speculative_tokens "
            "+ 1 rows"
        )
    return None


def _quantization(args: Any, cfg: Any) -> str | None:
    return check_quantization(
        cfg, args.quantization, args.quantization_group_size, args.quantize_activations
    )


def _memory(args: Any, cfg: Any) -> str | None:
    if args.memory_budget is not None:
        for other in ("num_blocks", "kv_cache_memory"):
            if getattr(args, other) is not None:
                return (
                    f"--memory-budget cannot be combined with {_flag(other, SET)}: both size "
                    "the KV pool"
                )
    return None


def _max_model_len(args: Any, cfg: Any) -> str | None:
    limit = args.max_model_len
    if limit is not None and not 1 <= limit <= cfg.max_position_embeddings:
        return (
            f"max_model_len must be in [1, {cfg.max_position_embeddings}] (the model's "
            f"max_position_embeddings), got {limit}"
        )
    return None


BOUNDS = (_speculation, _quantization, _memory, _max_model_len)


def _runs_scheme(args: Any, driver: Driver) -> str | None:
    """A quantization scheme needs a driver with a linear kernel for it (``hal.quant``)."""
    scheme = args.quantization
    if scheme is None or scheme in driver.quantization_schemes:
        return None
    runs = ", ".join(driver.quantization_schemes) or "none"
    return (
        f"--quantization {scheme}: driver {driver.label!r} offers no {scheme} linear kernel "
        f"(the quantization schemes it runs: {runs})"
    )


def _is(value: Any, wanted: Any) -> bool:
    return value is not None if wanted is SET else value == wanted


def _flag(name: str, value: Any) -> str:
    flag = "--" + name.replace("_", "-")
    return flag if value is True or value is SET else f"{flag} {value}"


def refused_pair(args: Any) -> str | None:
    """The first pair of ``REFUSED`` that ``args`` sets, as its message; None if none."""
    for a, va, b, vb, why in REFUSED:
        third = COMBINED_BY.get((a, b))
        if third is not None and getattr(args, third) is True:
            continue
        if _is(getattr(args, a), va) and _is(getattr(args, b), vb):
            return f"{_flag(a, va)} cannot be combined with {_flag(b, vb)}: {why}"
    return None


def why_not(
    args: Any, driver: Driver | None, backend: AttentionBackend | None, cfg: Any | None
) -> str | None:
    """Why an engine with options ``args`` cannot be built (the first reason), or None.
    Without a driver (or the model's config, an ``OuroConfig``) the rows that need one are
    not checked."""
    pair = refused_pair(args)
    if pair is not None:
        return pair
    if driver is not None and backend is not None:
        for name, value, capability in CAPABILITIES:
            if getattr(args, name) == value:
                missing = capability(driver, backend)
                if missing is not None:
                    return f"{_flag(name, value)}: {missing}"
    if driver is not None:
        missing = _runs_scheme(args, driver)
        if missing is not None:
            return missing
    if cfg is not None:
        for bound in BOUNDS:
            out = bound(args, cfg)
            if out is not None:
                return out
    return None


def check_engine(
    args: Any,
    driver: Driver | None = None,
    backend: AttentionBackend | None = None,
    cfg: Any | None = None,
) -> None:
    """Raise ValueError with the reason an engine with options ``args`` cannot be built."""
    why = why_not(args, driver, backend, cfg)
    if why is not None:
        raise ValueError(why)
