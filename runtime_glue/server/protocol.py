"""Pydantic models of the OpenAI request schema, with rlt-hal's limits made explicit.

Unknown fields are refused (naming the field) rather than silently ignored, and fields that
exist in the OpenAI API but that rlt-hal does not implement (``best_of``, ``suffix``) accept
only their neutral value, with an error that says "not supported" otherwise. Values go to
``SamplingParams``, whose checks give the 400s the pydantic ranges here do not.
"""

from __future__ import annotations

from typing import Annotated, Any, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime_glue.engine.sampling import MAX_LOGPROBS, SamplingParams
from runtime_glue.engine.structured import StructuredSpec, structured_spec
from runtime_glue.server.messages import ChatMessage
from runtime_glue.server.tools import Tool, ToolChoice

MAX_CHOICES = 1024  # choices per request (prompts x n): each is an engine request


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict:
        """The OpenAI error object, as a JSON response or an SSE event carries it."""
        return error_body(str(self), self.type, self.param, self.code)


class UnsupportedValue(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # OpenAI's: a last chunk, with no choices, carries the whole request's usage.
    include_usage: bool = False
    # vLLM's: every chunk carries the usage of its choice so far (its prompt's tokens and the
    # tokens that choice has generated).
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    # 0 only with echo or prompt_logprobs: the prompt scored, nothing generated (lm-eval's).
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    # Ouro's exit gate (runtime_glue.ouro.exits), as extra fields (vLLM's convention for fields of
    # one engine): which loop a token's logits come from, and whether to return each token's.
    exit_at_step: Annotated[int, Field(ge=0)] | None = None
    exit_threshold: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    weighted_exit: bool = False
    return_exit_steps: bool = False
    # Speculative decoding (runtime_glue.engine.speculative): drafts per verify step for this
    # request, 0 for none; needs a server started with --speculative-loops.
    num_speculative_tokens: Annotated[int, Field(ge=0, le=63)] | None = None
    # vLLM's field: requests share prefix-cache blocks only with requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices per prompt: choice 0 computes the prompt, the others share its KV pages (sample j
    # seeded seed + j, as vLLM).
    n: Annotated[int, Field(ge=1, le=128)] = 1
    user: str | None = None
    # The sampling stage (runtime_glue.engine.sampling), with OpenAI's and vLLM's ranges.
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    min_tokens: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    stop_token_ids: list[int] | None = None
    # vLLM's: the top N log-probabilities of every prompt token (the first: null).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Structured outputs (runtime_glue.engine.structured): OpenAI's and vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: with --reasoning-parser, the end tag forced after this many reasoning tokens.
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    # vLLM's: a scheduling priority, which its default first-come-first-served policy (and
    # rlt-hal's only one) refuses unless 0.
    priority: int = 0
    # vLLM's: special tokens in the text or not, the stop string kept at the end of the text
    # (SamplingParams), the caller's id for the request (the response's id is the prefix and
    # it), and logprobs' tokens named "token_id:N". spaces_between_special_tokens: accepted,
    # no effect with a fast tokenizer (the only kind loaded).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    return_tokens_as_token_ids: bool | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias}")
        return value

    def check_supported(self) -> None:
        if self.priority:
            raise UnsupportedValue(
                "priority",
                "priority scheduling is not enabled: requests run first come, first served "
                "(priority must be 0)",
            )
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options requires stream=true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise UnsupportedValue("stop", "stop strings must be non-empty")
        if self.max_tokens == 0 and not self._scores_prompt():
            raise UnsupportedValue(
                "max_tokens", "max_tokens must be >= 1 (0 only with echo or prompt_logprobs)"
            )

    def _scores_prompt(self) -> bool:
        return self.prompt_logprobs is not None

    def _logprobs(self) -> int | None:
        """The engine's ``logprobs``: top N with each generated token, or None."""
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def structured(self) -> StructuredSpec | None:
        """The request's structured-output spec (``response_format`` or
        ``structured_outputs``); raises ``StructuredOutputError`` naming the field."""
        return structured_spec(self.response_format, self.structured_outputs)

    def sampling_params(
        self, default_max_tokens: int, structured: StructuredSpec | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=self.stop or (),
            ignore_eos=self.ignore_eos,
            exit_at_step=self.exit_at_step,
            exit_threshold=self.exit_threshold,
            weighted_exit=self.weighted_exit,
            cache_salt=self.cache_salt,
            num_speculative_tokens=self.num_speculative_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            stop_token_ids=self.stop_token_ids or (),
            logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            structured_outputs=structured,
            thinking_token_budget=self.thinking_token_budget,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class CompletionRequest(_SamplingFields):
    # OpenAI's four shapes: a string, a list of token ids (one prompt each), or a batch: a
    # list of strings or of token-id lists, one prompt per entry.
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy logprobs: the top N (up to 20, vLLM's bound; OpenAI's is 5) per token.
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # The prompt's text first (with logprobs: its tokens' log-probabilities first too).
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str) or _is_ids(value):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of token ids, or a list of those")
        for i, entry in enumerate(value):
            if not (isinstance(entry, str) or _is_ids(entry)):
                raise ValueError(f"prompt[{i}] must be a string or a list of token ids")
        if len({isinstance(entry, str) for entry in value}) > 1:
            raise ValueError("a batch of prompts must be all strings or all token-id lists")
        return value

    @property
    def batched(self) -> bool:
        """Whether ``prompt`` is a list of prompts (errors then name ``prompt[i]``)."""
        p = self.prompt
        return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request, in order."""
        if self.batched:
            return list(cast("list[str | list[int]]", self.prompt))
        return [cast("str | list[int]", self.prompt)]

    def _scores_prompt(self) -> bool:
        return self.echo or self.prompt_logprobs is not None

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        """Echoed logprobs come from the engine's prompt logprobs (so does echo with
        max_tokens 0, which has nothing else to run)."""
        if self.prompt_logprobs is not None or not self.echo:
            return self.prompt_logprobs
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.max_tokens == 0 else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise UnsupportedValue("best_of", "best_of > 1 is not supported")
        if self.suffix:
            raise UnsupportedValue("suffix", "suffix is not supported")
        choices = len(self.prompts()) * self.n
        if choices > MAX_CHOICES:
            raise UnsupportedValue(
                "n" if self.n > 1 else "prompt",
                f"{len(self.prompts())} prompts x n={self.n} = {choices} choices; "
                f"a request may ask for at most {MAX_CHOICES}",
            )


# OpenAI chat fields that change nothing here, accepted as OpenAI defines them (README, "The
# request schema"): storage, billing and routing hints, and reasoning effort (with a reasoning
# parser, a thinking budget: Server.prepare). The openai package's own list of fields is the
# test's (tests/test_server_surface.py).
NO_EFFECT = (
    "metadata",
    "moderation",
    "prediction",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning_effort",
    "safety_identifier",
    "service_tier",
    "store",
    "verbosity",
)
# OpenAI chat fields asking for what rlt-hal cannot give: accepted when empty (null, or text
# only), else a 400 that says what to use.
NOT_HERE = {
    "audio": "audio output is not supported (the model writes text)",
    "web_search_options": "web search is not available here",
    "functions": "functions is deprecated by OpenAI; give them as tools",
    "function_call": "function_call is deprecated by OpenAI; use tool_choice",
}


class _OpenAIChatFields(BaseModel):
    """The rest of OpenAI's chat request schema (see NO_EFFECT and NOT_HERE)."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, str] | None = None
    moderation: Any = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def check_openai_fields(self) -> None:
        for name, why in NOT_HERE.items():
            if getattr(self, name):
                raise UnsupportedValue(name, why)
        if self.modalities and self.modalities != ["text"]:
            raise UnsupportedValue("modalities", 'only ["text"] is supported')


class ChatCompletionRequest(_SamplingFields, _OpenAIChatFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template controls: the assistant's turn opened (default), or the last
    # message continued (a prefill), and a template given with the request.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Annotated[str, Field(min_length=1)] | None = None
    # Extra variables for the chat template (e.g. a Thinking template's enable_thinking), as
    # vLLM passes them: over the request's own flags.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: with a reasoning parser, false leaves the reasoning out of the response.
    include_reasoning: bool = True

    def template_kwargs(self) -> dict[str, Any]:
        """What the request asks of the chat template (``apply_chat_template``'s names)."""
        kwargs: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return {**kwargs, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        self.check_openai_fields()
        kwargs = self.template_kwargs()  # (its keys were checked before the template ran)
        check_continuation(kwargs["add_generation_prompt"], kwargs["continue_final_message"])
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs needs logprobs=true")


# apply_chat_template's arguments that are not the template's to set: the renderer's own.
RENDERER_ARGUMENTS = frozenset(
    {"conversation", "messages", "tokenize", "return_tensors", "return_dict", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "chat_template", "tools", "documents", "padding",
     "truncation", "max_length"}
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs``: variables for the template, not the renderer's arguments (the
    template and the tools have fields of their own)."""
    bad = sorted(set(kwargs or {}) & RENDERER_ARGUMENTS)
    if bad:
        raise UnsupportedValue(
            "chat_template_kwargs",
            f"chat_template_kwargs sets {', '.join(map(repr, bad))}, which the renderer owns "
            "(give the template as chat_template, tools as tools)",
        )


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: the last message is continued or the assistant's turn opened, not both."""
    if add_generation_prompt and continue_final_message:
        raise UnsupportedValue(
            "continue_final_message", "continue_final_message needs add_generation_prompt=false"
        )


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_UNION_BRANCHES = {"str", "int", "float", "bool", "none", "dict", "list"}


def param_name(loc) -> str:
    """A pydantic error location as the field's name in the request: ``messages[0].content``
    (``body`` and the names pydantic gives a union's branches left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and "[" not in part and part not in _UNION_BRANCHES:
            out += f".{part}" if out else part
    return out
