"""vLLM's tokenizer endpoints and /version: what clients use to learn the tokenizer.

``POST /tokenize`` (a prompt, or chat messages through the template) returns ``count``,
``max_model_len``, ``tokens`` and, when asked, ``token_strs``; ``POST /detokenize`` turns
``tokens`` back into ``prompt``; ``GET /tokenizer_info`` is the tokenizer's configuration as
vLLM serves it (its ``init_kwargs``: special tokens, chat template, ``tokenizer_class``),
which lm-evaluation-harness reads to choose its remote tokenizer; ``GET /version``. Tokenizing
runs on the server's pool threads, never on the event loop.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from runtime_glue.server.messages import ChatMessage, MessageError, template_messages
from runtime_glue.server.protocol import (
    ApiError,
    UnsupportedValue,
    check_continuation,
    check_template_kwargs,
)


class TokenizeRequest(BaseModel):
    """vLLM's two request shapes in one: ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # By default the ids /v1/completions and /v1/chat/completions run: no special tokens
    # beyond the template's (vLLM's prompt default is true, but its completions add them).
    add_special_tokens: bool = False
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if name in self.model_fields_set:
                    raise ApiError(400, f"{name} applies to messages only", param=name)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def tokenizer_info(tokenizer) -> dict:
    """vLLM's ``TokenizerInfo``: the tokenizer's ``init_kwargs`` made JSON (special tokens as
    their text), less file paths, plus ``tokenizer_class``."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for path_field in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(path_field, None)  # this machine's paths: no use to a client
    config = _jsonable(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    return config


def _jsonable(obj):
    if hasattr(obj, "content"):  # AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _version() -> str:
    try:
        return metadata.version("rlt-hal")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def install_tokenizer_routes(app: FastAPI, server) -> None:
    info = tokenizer_info(server.tokenizing.tokenizer)
    version = _version()
    vocab = server.llm.engine.model.cfg.vocab_size

    @app.get("/version")
    async def get_version():
        return {"version": version}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request):
        server.check_auth(request)
        return info

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        server.check_auth(request)
        server.check_model(body.model)
        body.check()
        if body.messages is not None:
            try:
                messages = template_messages(body.messages)
            except MessageError as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            flags = {
                "add_generation_prompt": body.add_generation_prompt,
                "continue_final_message": body.continue_final_message,
                **(body.chat_template_kwargs or {}),
            }
            try:
                check_template_kwargs(body.chat_template_kwargs)
                check_continuation(flags["add_generation_prompt"], flags["continue_final_message"])
            except UnsupportedValue as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            ids = await server.chat_ids(
                messages, add_special_tokens=body.add_special_tokens, **flags
            )
        else:
            ids = await server.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = None
        if body.return_token_strs:
            strs = await server.tokenizing.run(0, lambda tok: tok.convert_ids_to_tokens(ids))
        return {
            "count": len(ids),
            "max_model_len": server.llm.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        server.check_auth(request)
        server.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(
                400,
                f"token ids {bad[:5]} are outside the vocabulary; they must be in [0, {vocab})",
                param="tokens",
            )
        ids = body.tokens
        text = await server.tokenizing.run(len(ids), lambda tok: tok.decode(ids))
        return {"prompt": text}
