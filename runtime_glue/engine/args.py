"""``EngineArgs``: every option that builds an engine, declared once.

The command line (``rlt-hal generate | serve | run | plan | parity | acceptance | eval |
bench``), ``LLM(...)``, the server and the Ray replicas all take their engine options from here:
a field's default, its type and its ``--flag`` help are written in one place, as vLLM's
``EngineArgs`` does. ``add_cli_args`` registers the fields on a parser (a command may take a
subset), ``from_cli_args`` reads them back, ``runtime_glue.engine.llm.build_llm`` builds
the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

DEFAULT_TOY_PRESET = "small"


def toy_banner(preset: str) -> str:
    """What a run without ``--model`` says about the embedded checkpoint of ``preset``."""
    if preset == "trained":
        return (
            "NOTE: no --model given; using the embedded 'trained' toy checkpoint: a small Ouro "
            "trained here on Python's own documentation, not Ouro-1.4B. Its text is "
            "documentation-like, not good prose. Pass --model /path/to/Ouro-1.4B for the real "
            "model."
        )
    return (
        f"NOTE: no --model given; using the embedded {preset!r} toy checkpoint with RANDOM "
        "weights. Its output is random text. Pass --model /path/to/Ouro-1.4B for a real model, "
        "or --preset trained for a small one trained here."
    )


ACTIVATION_CHOICES = ("none", "block", "token", "static")


def _activations_mode(value: Any) -> str | None:
    """``quantize_activations``: None (as the checkpoint says; else as given), "none",
    "block" or "token"; True and False are the older spelling ("block", None)."""
    if value is True:
        return "block"
    if value is False or value is None:
        return None
    if value not in ACTIVATION_CHOICES:
        raise ValueError(
            f"quantize_activations must be one of {', '.join(ACTIVATION_CHOICES)}, got {value!r}"
        )
    return value


def cli_field(default: Any, help: str, **argparse_options: Any) -> Any:
    """An attrs field that also describes its ``--flag`` (named after the field)."""
    return attrs.field(default=default, metadata={"help": help, "cli": argparse_options})


def _preset_names() -> list[str]:
    from runtime_glue.ouro.presets import PRESETS

    return list(PRESETS)


def add_fields(
    parser: argparse.ArgumentParser,
    cls: type,
    fields: Iterable[str] | None,
    exclusive: Sequence[tuple[str, str]] = (),
    group_title: str | None = None,
) -> None:
    """Register ``cls``'s fields (all, or ``fields``) as ``--flags`` on ``parser``; a pair in
    ``exclusive`` whose two fields are both registered becomes a mutually exclusive group."""
    chosen = [f for f in attrs.fields(cls) if fields is None or f.name in set(fields)]
    names = {f.name for f in chosen}
    unknown = set(fields or ()) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    target: Any = parser.add_argument_group(group_title) if group_title else parser
    groups: dict[str, Any] = {}
    for a, b in exclusive:
        if a in names and b in names:
            groups[a] = groups[b] = target.add_mutually_exclusive_group()
    for f in chosen:
        options = dict(f.metadata["cli"])
        if callable(options.get("choices")):
            options["choices"] = options["choices"]()
        if options.get("action") not in ("store_true", argparse.BooleanOptionalAction):
            options.setdefault("type", type(f.default) if f.default is not None else str)
        groups.get(f.name, target).add_argument(  # the help's formatter shows the default
            "--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"], **options
        )


def from_fields(cls: type, args: argparse.Namespace | dict, **overrides: Any) -> Any:
    """``cls`` from the fields ``args`` has (the others keep their defaults), then ``overrides``."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    values = {f.name: given[f.name] for f in attrs.fields(cls) if f.name in given}
    return cls(**{**values, **overrides})


SET = object()  # in REFUSED: the option is given at all
# Pairs of REFUSED that combine beside a third option set to True (the pair's reason says why).
COMBINED_BY = {("step_graphs", "adaptive_depth"): "depth_batching"}

# Every pair of options that does not combine, each with its arithmetic reason, checked where
# engines are made (runtime_glue.engine.refusals.check_engine). Everything else combines
# (README, "What combines with what"; tests/test_refusals.py builds every pair).
REFUSED = (
    (
        "mode", "hf-exact", "quantize_activations", "token",
        "Hugging Face's arithmetic quantizes no activations; per-token W8A8 runs in the "
        "deterministic and fast modes (--quantize-activations none runs the weights with bf16 "
        "activations, HF-exact)",
    ),
    (
        "deterministic", False, "quantize_activations", "token",
        "--no-deterministic is --mode hf-exact, and Hugging Face's arithmetic quantizes no "
        "activations (--quantize-activations none runs the weights with bf16 activations)",
    ),
    (
        "mode", "hf-exact", "quantize_activations", "static",
        "Hugging Face's arithmetic quantizes no activations; W8A8 static runs in the "
        "deterministic and fast modes (--quantize-activations none runs the weights with bf16 "
        "activations, HF-exact)",
    ),
    (
        "deterministic", False, "quantize_activations", "static",
        "--no-deterministic is --mode hf-exact, and Hugging Face's arithmetic quantizes no "
        "activations (--quantize-activations none runs the weights with bf16 activations)",
    ),
    (
        "speculative_loops", SET, "kv_sharing", "last",
        "under kv sharing a generated position's K/V is its last loop's, and a verify row "
        "cannot see the earlier drafts' last-loop K/V (their last loop runs in the same step)",
    ),
    (
        "speculative_loops", SET, "adaptive_depth", True,
        "adaptive depth changes the model's arithmetic, and speculation verifies against the "
        "full depth",
    ),
    (
        "step_graphs", True, "adaptive_depth", True,
        "deciding which rows leave after each loop reads the device, which a graph cannot "
        "(with --depth-batching rows leave between steps, and the three combine)",
    ),
    (
        "speculative_loops", SET, "depth_batching", True,
        "a verify row starts at the draft's last loop from a state its draft kept, and a "
        "depth row from the state its own last step kept: one step cannot lay out both yet",
    ),
    (
        "num_blocks", SET, "kv_cache_memory", SET,
        "both size the KV pool; give one",
    ),
)  # fmt: skip


@attrs.frozen(kw_only=True)
class EngineArgs:
    """What builds an ``LLM``: the checkpoint, the device, the KV pool, scheduling, the plan."""

    model: str | None = cli_field(
        None, "Ouro checkpoint directory (default: the embedded toy checkpoint of --preset)"
    )
    preset: str = cli_field(
        DEFAULT_TOY_PRESET,
        "the embedded toy checkpoint when no --model is given (random weights; 'trained' is "
        "trained here on first use, minutes, then cached)",
        choices=_preset_names,
    )
    device: str | None = cli_field(
        None, "cpu, cuda[:N], npu[:N] or auto (default: $VLLM_RLT_DEVICE or auto)"
    )
    dtype: str = cli_field(
        "bfloat16",
        "weights and KV cache dtype (the first scope: bfloat16 only)",
        choices=["bfloat16"],
    )
    attention_backend: str | None = cli_field(
        None, "e.g. cpu_eager, cuda_sdpa, ascend_eager (default: the driver's HF-order backend)"
    )
    linear: str | None = cli_field(
        None,
        "one projection kernel for every projection: torch (F.linear, HF-exact) or one the "
        "driver offers, e.g. avx2 or avx512bf16 on cpu (not HF-exact). Default: torch in "
        "HF-exact mode; in deterministic mode the fastest that keeps the mode, measured here "
        "(rlt-hal plan shows the choice)",
    )
    quantization: str | None = cli_field(
        None,
        "weight-only quantization made at load from the bf16 checkpoint: int8 (symmetric, one "
        "scale per output channel), int8g (int8, one scale per --quantization-group-size inputs, "
        "as llm-compressor's W8A16), int4 (symmetric, one scale per --quantization-group-size "
        "inputs) or int8z (asymmetric int8, a scale and a zero point per "
        "--quantization-group-size inputs, as msModelSlim's asymmetric W8A16). The embedding, "
        "the exit gate and lm_head stay bf16 (see --quantize-lm-head). A checkpoint quantized "
        "elsewhere (compressed-tensors, msModelSlim) runs its own scheme",
        choices=("int8", "int8g", "int4", "int8z"),
    )
    quantization_group_size: int = cli_field(
        32, "int4, int8g and int8z: inputs per scale (32, 64 or 128)", choices=(32, 64, 128)
    )
    quantize_lm_head: bool = cli_field(
        False, "with --quantization, quantize lm_head too", action="store_true"
    )
    quantize_activations: str | None = attrs.field(
        default=None,
        converter=_activations_mode,
        metadata={
            "help": "with --quantization: 'block' (alone: --quantize-activations) lets the plan "
            "also use kernels that quantize the activations per block of 32 as llama.cpp's Q8_0 "
            "does, with integer dot products (W8A8 / W4A8): faster where decode is bound by "
            "instructions, not bytes; another arithmetic. 'token' quantizes every projection's "
            "activations per token as vllm-ascend's W8A8 dynamic (int8 weights per channel; "
            "what a W8A8_DYNAMIC checkpoint runs by default). 'static' quantizes them with the "
            "calibrated input scale and offset a W8A8 static checkpoint stores (msModelSlim's "
            "W8A8; what it runs by default). 'none': activations as given, also for a "
            "checkpoint that stores W8A8",
            "cli": {"choices": ACTIVATION_CHOICES, "nargs": "?", "const": "block"},
        },
    )
    block_size: int = cli_field(128, "tokens per KV block (a power of two >= 16)")
    max_model_len: int | None = cli_field(
        None,
        "the most tokens (prompt + output) a request may have, as vLLM's --max-model-len; the "
        "KV pool must hold one such request (default: the model's max_position_embeddings)",
        type=int,
    )
    num_blocks: int | None = cli_field(
        None, "KV pool size in blocks (default: as many as --kv-cache-memory holds)", type=int
    )
    kv_cache_memory: int | None = cli_field(
        None, "KV pool size in bytes (default 512 MiB)", type=int, metavar="BYTES"
    )
    memory_budget: int | None = cli_field(
        None,
        "bytes for the weights as loaded and the KV pool together: the pool takes what the "
        "weights leave (smaller with --quantization), instead of a fixed --kv-cache-memory",
        type=int,
        metavar="BYTES",
    )
    max_num_seqs: int = cli_field(16, "requests running at once")
    max_num_batched_tokens: int = cli_field(8192, "tokens one step computes at most")
    prefill_chunk_size: int | None = cli_field(
        None, "prefill prompts in chunks of N tokens (default: whole)", type=int
    )
    deterministic: bool | None = cli_field(
        None,
        "bit-identical results whatever the chunk size or batch mix; --no-deterministic "
        "keeps HF's own bits for a lone request (default: the backend's choice, on for cpu)",
        action=argparse.BooleanOptionalAction,
    )
    mode: str | None = cli_field(
        None,
        "fast: the driver's fused kernels, each admitted only after a check against float64 on "
        "this device at this model's shapes (rlt-hal plan shows each verdict; not HF-exact); "
        "deterministic or hf-exact: as --deterministic / --no-deterministic (default: the "
        "backend's choice)",
        choices=["fast", "deterministic", "hf-exact"],
    )
    remeasure_plan: bool = cli_field(
        False,
        "time the kernels again and record the new choice for this machine and model shape; "
        "otherwise deterministic mode reuses the recorded one (a new choice can change a "
        "request's bits: rlt-hal plan shows the choice, where it is recorded and when)",
        action="store_true",
    )
    exit_threshold: float | None = cli_field(
        None,
        "default exit threshold of Ouro's gate for requests that choose none (in (0, 1]; "
        "default: the checkpoint's early_exit_threshold)",
        type=float,
    )
    exit_at_step: int | None = cli_field(
        None,
        "default loop to read logits from, for requests that choose none (0 .. loops - 1; "
        "default: the checkpoint's early_exit_step, else its threshold, else the last loop)",
        type=int,
    )
    adaptive_depth: bool = cli_field(
        False,
        "decode rows that reach their exit threshold skip their remaining loops (an "
        "approximation: docs/benchmarks.md)",
        action="store_true",
    )
    depth_batching: bool = cli_field(
        False,
        "depth-wise batching: a generated token runs one of its loops a step, beside rows "
        "at other loops in the same pass over the layers (docs/depth-batching.md): every loop "
        "runs, the same bits as plain decoding in deterministic mode; with --adaptive-depth a "
        "token leaves after its exit loop, with adaptive depth's bits",
        action="store_true",
    )
    enable_prefix_caching: bool | None = cli_field(
        None,
        "share the KV of prompt blocks already computed (default: on in deterministic "
        "mode, where a hit gives exactly the bits of recomputing; off in HF-exact mode, where "
        "the bits may differ within the engine's tolerance)",
        action=argparse.BooleanOptionalAction,
    )
    # Decode KV sharing (runtime_glue.engine.shared_blocks, hal.shared_kv).
    kv_sharing: str = cli_field(
        "none",
        "decode KV: 'none' keeps every loop's K/V of every position; 'last' keeps generated "
        "positions' K/V in one plane per layer that every loop reads and writes (the Ouro "
        "paper's last-step reuse: a generated token costs 1/loops of the KV; changes the "
        "arithmetic, see README)",
        choices=["none", "last"],
    )

    # -- step graphs (runtime_glue.engine.graphs) --
    step_graphs: bool | None = cli_field(
        None,
        "capture decode-only steps as device graphs (cuda, npu) and replay them: one host "
        "call per step instead of one per op; prefill and mixed steps run eagerly; admitted "
        "only if a replay equals the eager step bit for bit at start-up (default: on with "
        "--mode fast where the driver offers graphs, else off)",
        action=argparse.BooleanOptionalAction,
    )

    # Speculative decoding (runtime_glue.engine.speculative): exact, from the model's own loops.
    speculative_loops: int | None = cli_field(
        None,
        "draft with the first E loops and verify with the rest, exactly (E in 1 .. loops - 1; "
        "default: off)",
        type=int,
        metavar="E",
    )
    num_speculative_tokens: int | None = cli_field(
        None,
        "tokens drafted per verify step with --speculative-loops (default: 4)",
        type=int,
        metavar="K",
    )

    # Thinking models (runtime_glue.engine.reasoning).
    reasoning_parser: str | None = cli_field(
        None,
        "split a Thinking model's <think> ... </think> from its answer: chat responses carry "
        "it as message.reasoning (and reasoning_content), streams as delta.reasoning, LLM.chat "
        "as output.reasoning; a grammar or tool call starts after it, and requests may bound "
        "it with thinking_token_budget (vLLM's flag; deepseek_r1: the opening tag optional, as when the template opened the "
        "block; qwen3: only an opened block is reasoning)",
        choices=("deepseek_r1", "qwen3"),
    )

    # Pairs the command line takes one of: --model or --preset, and every pair the engine
    # refuses whenever both are given (runtime_glue.engine.refusals).
    EXCLUSIVE = (("model", "preset"), *((a, b) for a, x, b, y, _ in REFUSED if x is y is SET))

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        fields: Iterable[str] | None = None,
    ) -> None:
        """Register every engine option (or only ``fields``) on ``parser``."""
        add_fields(parser, cls, fields, cls.EXCLUSIVE)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace | dict, **overrides: Any) -> EngineArgs:
        return from_fields(cls, args, **overrides)

    def banner(self) -> str | None:
        """What to tell a user about the weights before loading: None when --model is given."""
        return None if self.model is not None else toy_banner(self.preset)

    def model_dir(self) -> Path:
        """``model``, or the embedded toy checkpoint of ``preset`` (written once, then cached)."""
        if self.model is not None:
            return Path(self.model)
        from runtime_glue.ouro.toy import cached_checkpoint

        return cached_checkpoint(self.preset)
