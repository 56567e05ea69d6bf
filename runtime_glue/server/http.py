"""HTTP plumbing of the app: the request-body limit (an ASGI middleware) and the handlers that
turn every error (ours, pydantic's, Starlette's) into OpenAI's error shape, naming the field."""

from __future__ import annotations

import difflib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime_glue.server.protocol import ApiError, error_body, param_name


def json_error(status, message, type_="invalid_request_error", param=None, code=None):
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered with an OpenAI-shaped
    413 before anything buffers it. A declared Content-Length is checked up front; a body sent
    without one is read up to the limit, then handed on as it was."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if int(declared) > self.max_bytes:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            chunks.append(message)
            if not message.get("more_body"):
                return await self.app(scope, _replay(chunks), send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"the request body exceeds {self.max_bytes} bytes (--max-request-bytes)"
        body = error_body(message, "invalid_request_error", None, "request_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _replay(messages):
    pending = list(messages)

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    return receive


# vLLM's deprecated guided decoding fields -> the structured_outputs key that replaced each.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
    "guided_decoding_backend": None,
}


def unknown_field(param: str, path: str = "") -> str:
    """The message for a field the schema lacks: where vLLM moved it, or what it may be a typo
    of (among the fields of the endpoint at ``path``)."""
    if param in GUIDED:
        key = GUIDED[param]
        to = f'"structured_outputs": {{"{key}": ...}}' if key else "structured_outputs"
        return f"{param} was removed (vLLM deprecated it): use {to}"
    message = f"unknown field {param!r} is not supported"
    if "." in param or "[" in param:
        return message
    from runtime_glue.server.protocol import ChatCompletionRequest, CompletionRequest
    from runtime_glue.server.response_input import CHAT_NAMES, ResponsesRequest

    if path.startswith("/v1/responses"):
        if param in CHAT_NAMES:  # a chat request's field, which the Responses API names anew
            return message + f" (did you mean {CHAT_NAMES[param]!r}?)"
        names = set(ResponsesRequest.model_fields)
    else:
        names = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    close = difflib.get_close_matches(param, sorted(names), 1)
    return message + (f" (did you mean {close[0]!r}?)" if close else "")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        err = exc.errors()[0]
        param = param_name(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            return json_error(400, "the request body is not valid JSON")
        if err.get("type") == "extra_forbidden":
            return json_error(400, unknown_field(param, request.url.path), param=param)
        return json_error(400, f"{param or 'body'}: {err.get('msg')}", param=param or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_error(exc.status_code, str(exc.detail), kind)
