"""Structured outputs: JSON schemas, regexes, choices and grammars enforced on the logits.

Three steps, each a small value or object:

- ``parse_structured`` (vLLM's ``structured_outputs`` dict) and ``from_response_format``
  (OpenAI's ``response_format``) check the request's shape and give a frozen
  ``StructuredSpec``, or raise ``StructuredOutputError`` naming the field;
- ``GrammarCompiler`` (one per model) compiles a spec for the model's tokenizer with
  llguidance and caches the result; an invalid schema, regex or grammar raises here, before any
  compute, so a server answers 400;
- a ``Matcher`` per request follows the accepted tokens and gives the next token's mask.

Masks are bool ``[vocab_size]`` CPU tensors over the MODEL's vocabulary: ids the tokenizer does
not have are never allowed, and the mask is never empty (when nothing else can follow, the EOS
ids are the whole mask). EOS is handled here, not by the engine: it is allowed exactly when the
output so far is complete, and after it only EOS is.

Speculative decoding: the mask at verify position ``i`` is the mask after accepting drafts
``0..i-1``; ``Matcher.draft_masks`` gives them all and leaves the matcher as it was; then
``accept`` the tokens the verify keeps (``rollback`` undoes tokens taken ahead).
llguidance is imported on first use, never at module import (docs/structured-outputs.md).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar")
# vLLM's StructuredOutputsParams fields besides the kinds (disable_fallback: there is no fallback).
_OPTIONS = ("json_object", "disable_any_whitespace", "whitespace_pattern", "disable_fallback")
_ANY_OBJECT = '{"type":"object"}'


class StructuredOutputError(ValueError):
    """Bad structured-output input; ``param`` is the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@attrs.frozen
class StructuredSpec:
    """What a request's output must match. Equal specs compile to the same grammar.

    ``text``: json, the schema as compact JSON (property order kept: it is the output's order);
    choice, a JSON list of the strings; regex, as given (Rust ``regex`` syntax, matched whole);
    grammar, as given (Lark, or GBNF which llguidance converts to Lark).
    ``strict`` (json): a keyword the engine cannot enforce is an error; False ignores it.
    ``whitespace`` (json): a regex for whitespace between tokens; None any, "" none.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    text: str
    strict: bool = True
    whitespace: str | None = None
    param: str = attrs.field(default="structured_outputs", eq=False)


def _fail(param: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(f"{param} {message}", param)


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _fail(param, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _fail(param, f"must be a JSON schema object, got {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _nonempty_str(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(param, f"must be a non-empty string, got {value!r:.40}")
    return value


def _whitespace(spec: dict, param: str) -> str | None:
    pattern = spec.get("whitespace_pattern")
    if pattern is not None:
        return _nonempty_str(pattern, f"{param}.whitespace_pattern")
    return "" if spec.get("disable_any_whitespace") else None


def parse_structured(spec: Any, param: str = "structured_outputs") -> StructuredSpec:
    """vLLM's ``structured_outputs`` dict: exactly one of ``json`` (a schema, or its JSON text),
    ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF) or ``json_object:
    true``; optional ``disable_any_whitespace`` / ``whitespace_pattern`` (json only)."""
    if not isinstance(spec, dict):
        raise _fail(param, f"must be an object with one of {', '.join(KINDS)}")
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS) - set(_OPTIONS))
    if unknown:
        raise _fail(param, f"has unknown field(s) {unknown}; known: {[*KINDS, *_OPTIONS]}")
    chosen = [k for k in (*KINDS, "json_object") if k in given]
    if len(chosen) != 1:
        raise _fail(param, f"must set exactly one of {', '.join(KINDS)}, got {chosen or 'none'}")
    kind, value, where = chosen[0], given[chosen[0]], f"{param}.{chosen[0]}"
    if kind in ("json", "json_object"):
        text = _ANY_OBJECT if kind == "json_object" else _schema_text(value, where)
        return StructuredSpec("json", text, whitespace=_whitespace(given, param), param=where)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _fail(where, f"must be a non-empty list of strings, got {value!r:.60}")
        return StructuredSpec("choice", json.dumps(value, ensure_ascii=False), param=where)
    return StructuredSpec(kind, _nonempty_str(value, where), param=where)


def from_response_format(response_format: Any) -> StructuredSpec | None:
    """OpenAI's ``response_format``: ``text`` gives None, ``json_object`` any JSON object,
    ``json_schema`` its ``schema`` (``strict: true`` refuses keywords that cannot be enforced;
    otherwise they are ignored, as OpenAI's non-strict mode promises no more)."""
    param = "response_format"
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _fail(param, "must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json", _ANY_OBJECT, param=param)
    if kind != "json_schema":
        raise _fail(f"{param}.type", f"must be text, json_object or json_schema, got {kind!r}")
    js = response_format.get("json_schema")
    if not isinstance(js, dict):
        raise _fail(f"{param}.json_schema", "must be an object with a name and a schema")
    name = js.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise _fail(f"{param}.json_schema.name", f"must be a string of 1 to 64 chars, got {name!r}")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _fail(f"{param}.json_schema.strict", f"must be true or false, got {strict!r}")
    where = f"{param}.json_schema.schema"
    text = _schema_text(js["schema"], where) if "schema" in js else _ANY_OBJECT
    return StructuredSpec("json", text, strict=bool(strict), param=where)


def structured_spec(
    response_format: Any = None, structured_outputs: Any = None
) -> StructuredSpec | None:
    """The request's one spec, from either field (setting both is an error)."""
    from_rf = from_response_format(response_format)
    if structured_outputs is None:
        return from_rf
    if from_rf is not None:
        raise _fail("structured_outputs", "cannot be combined with a json response_format")
    return parse_structured(structured_outputs)


def _grammar(spec: StructuredSpec) -> str:
    import llguidance

    if spec.kind != "json":
        return llguidance.grammar_from(spec.kind, spec.text)  # type: ignore[arg-type]
    options: dict[str, Any] = {"lenient": not spec.strict}
    options["whitespace_flexible"] = spec.whitespace != ""
    if spec.whitespace:
        options["whitespace_pattern"] = spec.whitespace
    return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=options)  # type: ignore[arg-type]


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer: a pristine matcher that requests copy."""

    spec: StructuredSpec
    prototype: Any  # llguidance.LLMatcher at the grammar's start; never advanced


class GrammarCompiler:
    """One per model: the tokenizer's token table (built on first use, 0.3 s at 49k tokens) and
    a bounded LRU of compiled grammars keyed by spec. Thread-safe."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = (), cache_size: int = 256
    ):
        eos = tuple(eos_token_ids) or (tokenizer.eos_token_id,)
        if not eos or any(e is None or not 0 <= e < vocab_size for e in eos):
            raise ValueError(f"eos_token_ids must be ids in [0, {vocab_size}), got {eos}")
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos
        self.cache_size = cache_size
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                # One EOS id: Matcher sets the EOS bits itself (and llguidance 1.0 takes one)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, eos_token=self.eos_token_ids[0]
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``; raises ``StructuredOutputError`` naming
        ``spec.param`` when the schema, regex or grammar is invalid or unsupported."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        import llguidance

        tok = self.ll_tokenizer()
        try:  # the matcher compiles (dropping the GIL); an invalid input leaves it in error
            matcher = llguidance.LLMatcher(tok, _grammar(spec), log_level=0)
            error = matcher.get_error()
        except ValueError as exc:  # JSON that is no schema, GBNF that does not convert
            error = str(exc) or type(exc).__name__
        if error:
            message = " ".join(error.split())
            message = message[:1].lower() + message[1:]
            what = "json schema" if spec.kind == "json" else spec.kind
            raise StructuredOutputError(f"{spec.param}: invalid {what}: {message}", spec.param)
        for warning in matcher.get_grammar_warnings():
            logger.warning("%s: %s", spec.param, warning)
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec_or_compiled: StructuredSpec | CompiledGrammar) -> Matcher:
        """A fresh matcher at the start of the grammar (compiling ``spec`` if need be)."""
        c = spec_or_compiled
        return Matcher(self, c if isinstance(c, CompiledGrammar) else self.compile(c))


class MaskSteps:
    """The masks of tokens taken ahead, for any matcher with ``accept``, ``allowed`` and
    ``rollback`` (``Matcher``; ``reasoning.ReasoningMatcher``)."""

    vocab_size: int

    def accept(self, token_id: int) -> bool:
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        raise NotImplementedError

    def allowed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def settled(self):
        """What masks the rest of the output (``ReasoningMatcher``: the grammar, once the
        reasoning ended)."""
        return self

    def allowed_after(self, drafted: Sequence[int]) -> torch.Tensor:
        """The mask after ``drafted``, tokens taken ahead of the accepted ones (a speculative
        round's drafts before a draft or verify row), the matcher left as it was."""
        if not drafted:
            return self.allowed()
        masks, _ = self.draft_masks(drafted)
        return masks[-1]

    def draft_masks(
        self, drafts: Sequence[int], out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """The masks of a speculative verify: row ``i`` is the mask after accepting
        ``drafts[:i]`` (row 0: now), ``[len(drafts) + 1, vocab_size]``. Also returns how many
        drafts the grammar allows in a row; later rows repeat the last valid one (the verify
        rejects there anyway). The matcher ends where it began."""
        k = len(drafts)
        out = torch.empty(k + 1, self.vocab_size, dtype=torch.bool) if out is None else out
        n = 0
        self.allowed(out[0])
        for token in drafts:
            if not self.accept(token):
                break
            n += 1
            self.allowed(out[n])
        out[n + 1 :] = out[n]
        self.rollback(n)
        return out, n


class Matcher(MaskSteps):
    """One request's position in its grammar. Not thread-safe (a request is one thread's)."""

    def __init__(self, compiler: GrammarCompiler, compiled: CompiledGrammar):
        self.vocab_size, self.eos = compiler.vocab_size, compiler.eos_token_ids
        self._ll = compiled.prototype.deep_copy()
        n = compiler.ll_tokenizer().vocab_size  # the tokenizer's ids, maybe != vocab_size
        self._words = torch.zeros((n + 31) // 32, dtype=torch.int32)
        self._known = min(n, self.vocab_size)
        self._mask = np.zeros(self.vocab_size, dtype=np.bool_)
        self._blocked = np.empty(self.vocab_size, dtype=np.bool_)
        self._eos_np = np.array(self.eos)
        self._eos_seen = 0  # EOS tokens accepted (not given to llguidance: see rollback)
        self.num_accepted = 0
        self.error: str | None = None  # set if the engine failed mid-way; the mask is then EOS

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow: the output is complete (and closed) or EOS was taken."""
        return bool(self._eos_seen) or self._ll.is_stopped() or self.error is not None

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the mask does not allow it."""
        if token_id in self.eos:
            if not (self.is_terminated() or self._ll.is_accepting()):
                return False
            self._eos_seen += 1
        else:
            known = not self._eos_seen and 0 <= token_id < self._known
            if not known or self._ll.try_consume_tokens([token_id]) != 1:
                return False
        self.num_accepted += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (rejected drafts)."""
        if not 0 <= n <= self.num_accepted:
            raise ValueError(f"rollback n must be in [0, {self.num_accepted}], got {n}")
        eos = min(n, self._eos_seen)
        self._eos_seen -= eos
        if n - eos and not self._ll.rollback(n - eos):
            raise RuntimeError(f"llguidance could not roll back {n - eos} tokens")
        self.num_accepted -= n

    def _fill(self) -> np.ndarray:
        """The next token's mask into ``self._mask`` (numpy: a tenth of torch's small-op cost)."""
        mask, eos, w = self._mask, self._eos_np, self._words
        if not self.is_terminated():
            self._ll.unsafe_compute_mask_ptr(w.data_ptr(), w.numel() * 4)
            if self._ll.is_error():
                self.error = self._ll.get_error()
                logger.warning("grammar matcher failed, ending the output: %s", self.error)
        if self.is_terminated():
            mask[:] = False
            mask[eos] = True
            return mask
        bits = np.unpackbits(w.numpy().view(np.uint8), count=self._known, bitorder="little")
        mask[: self._known] = bits.view(np.bool_)  # ids past the tokenizer's stay False
        mask[eos] = self._ll.is_accepting()
        if not mask.any():  # the grammar needs an id past the model's vocabulary
            mask[eos] = True
        return mask

    def allowed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The next token's mask: bool ``[vocab_size]`` (written into ``out`` if given: a row of
        a batch's mask, on any device)."""
        mask = torch.from_numpy(self._fill())
        return mask.clone() if out is None else out.copy_(mask)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the masked-out entries of a ``[vocab_size]`` logits row to -inf, in place."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(
                f"logits must have shape ({self.vocab_size},), got {tuple(logits.shape)}"
            )
        blocked = torch.from_numpy(np.logical_not(self._fill(), out=self._blocked))
        logits.masked_fill_(blocked.to(logits.device), float("-inf"))
