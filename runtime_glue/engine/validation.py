"""Requests that could never run: refused before they are queued ("never", not "not now").

:func:`check_request` is what ``Engine.validate`` runs for every entry point (engine, ``LLM``,
server): the prompt, the exit loop, speculation, the structured-output grammar, the token ids
a request names (prompt, ``logit_bias``, ``stop_token_ids``) against the vocabulary, the model's
length, the pool (as the KV placement counts it) and full prefill's budget.
"""

from __future__ import annotations

from typing import Any

from runtime_glue.engine.refusals import MAX_SPECULATIVE_TOKENS
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.structured import (
    CompiledGrammar,
    GrammarCompiler,
    StructuredOutputError,
    StructuredSpec,
    parse_structured,
)


class InvalidRequest(ValueError):
    """A request that could never run; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_request(engine: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise InvalidRequest for a request that could never run on ``engine``."""
    max_tokens = params.max_tokens
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    loops = engine.model.cfg.total_ut_steps
    if params.exit_at_step is not None and not 0 <= params.exit_at_step < loops:
        raise InvalidRequest(
            f"exit_at_step must be in [0, {loops}) (the model runs {loops} loops), "
            f"got {params.exit_at_step}",
            "exit_at_step",
        )
    if params.num_speculative_tokens:
        _check_speculation(engine, params.num_speculative_tokens)
    if params.structured_outputs is not None:
        # an invalid schema, regex or grammar is refused before compute
        compile_grammar(engine.grammar_compiler(), params)
    _check_reasoning(engine, params)
    vocab = engine.model.cfg.vocab_size
    for name, ids in (
        ("prompt", prompt_token_ids),
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            what = "token ids" if name == "prompt" else f"{name} token ids"
            raise InvalidRequest(
                f"{what} {bad[:5]} are outside the vocabulary; they must be in [0, {vocab})",
                name,
            )
    n = len(prompt_token_ids)
    need = n + max_tokens
    if need > engine.max_model_len:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {need} "
            f"exceeds the model's maximum length of {engine.max_model_len} tokens",
            "max_tokens",
        )
    too_big = engine.kv.pool_refusal(n, need, engine.pool_blocks)
    if too_big is not None:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) {too_big}", "max_tokens"
        )
    if engine.config.prefill_chunk_size is None and n > engine.config.max_num_batched_tokens:
        raise InvalidRequest(
            f"prompt of {n} tokens exceeds max_num_batched_tokens "
            f"({engine.config.max_num_batched_tokens}) with full prefill; raise "
            "--max-num-batched-tokens or set --prefill-chunk-size",
            "prompt",
        )


def _check_reasoning(engine: Any, params: SamplingParams) -> None:
    """A thinking budget needs a reasoning parser whose tags are single tokens."""
    if params.thinking_token_budget is None:
        return
    if engine.reasoning is None:
        raise InvalidRequest(
            "thinking_token_budget needs a reasoning parser (--reasoning-parser)",
            "thinking_token_budget",
        )
    why = engine.thinking_tags()
    if isinstance(why, str):
        raise InvalidRequest(f"thinking_token_budget: {why}", "thinking_token_budget")


def compile_grammar(
    compiler: GrammarCompiler | None, params: SamplingParams
) -> CompiledGrammar | None:
    """The compiled grammar of ``params.structured_outputs`` (cached by spec), or None;
    an invalid one raises InvalidRequest naming the field."""
    spec = params.structured_outputs
    if spec is None:
        return None
    if compiler is None:
        raise InvalidRequest(
            "structured outputs need the engine's tokenizer (build it with LLM)",
            "structured_outputs",
        )
    try:
        if not isinstance(spec, StructuredSpec):
            spec = parse_structured(dict(spec))
        return compiler.compile(spec)
    except StructuredOutputError as exc:
        raise InvalidRequest(str(exc), exc.param) from None


def _check_speculation(engine: Any, k: int) -> None:
    if engine.speculator is None:
        raise InvalidRequest(
            "num_speculative_tokens needs an engine started with --speculative-loops",
            "num_speculative_tokens",
        )
    most = min(MAX_SPECULATIVE_TOKENS, engine.config.max_num_batched_tokens - 1)
    if k > most:
        raise InvalidRequest(
            f"num_speculative_tokens must be in [0, {most}] (a verify step computes k + 1 "
            f"rows, within max_num_batched_tokens), got {k}",
            "num_speculative_tokens",
        )
