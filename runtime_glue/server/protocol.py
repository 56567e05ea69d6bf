"""Pydantic models of the OpenAI request schema, with rlt-hal's limits made explicit.

Unknown fields are refused (naming the field) rather than silently ignored, and fields that
exist in the OpenAI API but that rlt-hal does not implement accept only their neutral value,
with an error that says "not supported" otherwise.
"""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime_glue.engine.sampling import SamplingParams


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
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
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
    n: int = 1
    user: str | None = None
    # OpenAI fields rlt-hal does not implement: only their neutral value is accepted.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise UnsupportedValue("n", f"n={self.n} is not supported; rlt-hal returns one choice")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedValue(name, f"{name} is not supported (must be 0)")
        if self.logit_bias:
            raise UnsupportedValue("logit_bias", "logit_bias is not supported")
        if self.logprobs:
            raise UnsupportedValue("logprobs", "logprobs are not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options requires stream=true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise UnsupportedValue("stop", "stop strings must be non-empty")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
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
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedValue("echo", "echo=true is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedValue("best_of", "best_of > 1 is not supported")
        if self.suffix:
            raise UnsupportedValue("suffix", "suffix is not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            raise UnsupportedValue(
                "prompt", "batched prompts are not supported; send one prompt per request"
            )

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one (check_supported refused larger ones)
        return cast("str | list[int]", p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
