"""The app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics here; the
tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and /version in
``tokenizer_api``."""

from __future__ import annotations

import asyncio
import errno
import hmac
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime_glue.engine.args import EngineArgs
from runtime_glue.engine.core import InvalidRequest
from runtime_glue.engine.llm import build_llm
from runtime_glue.engine.request import RequestOutput
from runtime_glue.server import DEFAULT_MAX_REQUEST_BYTES
from runtime_glue.server.args import ServerArgs
from runtime_glue.server.engine_loop import EngineFailed, EngineLoop
from runtime_glue.server.messages import MessageError, template_messages
from runtime_glue.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedValue,
    error_body,
)
from runtime_glue.server.routes import Choice, chat_response, completion_response, plan_choices
from runtime_glue.server.tokenizer_api import install_tokenizer_routes
from runtime_glue.server.tokenizing import Tokenizing


def _json_error(status, message, type_="invalid_request_error", param=None, code=None):
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class Server:
    """Holds the engine loop and turns OpenAI requests into engine requests."""

    @classmethod
    def from_args(cls, llm, engine: EngineArgs, options: ServerArgs) -> Server:
        return cls(
            llm,
            options.model_name(engine),
            api_key=options.api_key,
            default_max_tokens=options.default_max_tokens,
            max_request_bytes=options.max_request_bytes,
            shutdown_timeout=options.shutdown_timeout,
        )

    def __init__(
        self,
        llm,
        served_model_name: str,
        api_key: str | None = None,
        default_max_tokens: int = 16,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        shutdown_timeout: float = 10.0,
    ) -> None:
        self.llm = llm
        self.tokenizing = Tokenizing(llm.model_dir)  # off the event loop, bounded
        self.shutdown_timeout = shutdown_timeout
        self.model_name = served_model_name
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.max_request_bytes = max_request_bytes
        self.loop = EngineLoop(llm.engine)
        self.created = int(time.time())

    # -- request preparation (handler side: validation and tokenisation only) ------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
            what = "missing" if not header else "invalid"
            raise ApiError(
                401,
                f"{what} API key; send 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def prepare(self, body, prompts: list[list[int]]) -> list[Choice]:
        """The request's choices, every prompt validated before any runs."""
        self.loop.check()  # a dead engine answers 503 before a response (or stream) begins
        if self.loop.draining:
            raise ApiError(503, "the server is shutting down", "server_error")
        try:
            body.check_supported()
            params = body.sampling_params(self.default_max_tokens)
        except UnsupportedValue as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        batched = isinstance(body, CompletionRequest) and body.batched
        for i, ids in enumerate(prompts):
            try:
                self.llm.engine.validate(ids, params)
            except InvalidRequest as exc:
                if not batched:
                    raise ApiError(400, str(exc), param=exc.param) from None
                param = f"prompt[{i}]" if exc.param == "prompt" else exc.param
                raise ApiError(400, f"prompt[{i}]: {exc}", param=param) from None
        return plan_choices(prompts, params, body.n)

    async def prompts(self, body) -> list[list[int]]:
        """The request's prompts as token ids, tokenized (and templated) on pool threads."""
        if isinstance(body, ChatCompletionRequest):
            try:
                messages = template_messages(body.messages)
            except MessageError as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            return [await self.chat_ids(messages)]
        return list(await asyncio.gather(*(self.encode(p) for p in body.prompts())))

    async def encode(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        return await self.tokenizing.run(
            len(prompt), lambda tok: tok.encode(prompt, add_special_tokens=add_special_tokens)
        )

    async def chat_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """``messages`` through the checkpoint's chat template; a template that fails on
        them (a role it refuses, an empty conversation) is the request's fault: 400."""
        size = sum(len(str(m.get("content", ""))) for m in messages)
        kwargs = {"add_generation_prompt": True, **template_kwargs}
        try:
            return await self.tokenizing.run(size, lambda tok: _chat_ids(tok, messages, **kwargs))
        except (jinja2.TemplateError, ValueError) as exc:  # ValueError: transformers' checks
            raise ApiError(
                400, f"the chat template failed on these messages: {exc}", param="messages"
            ) from None

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM: admit nothing more; what runs gets ``shutdown_timeout`` seconds,
        then a 503 (``EngineLoop.drain``)."""
        self.loop.drain(self.shutdown_timeout)

    # -- running a request -----------------------------------------------------------------

    async def outputs(
        self, rid: str, ids: list[int], params, request: Request
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request; aborts it if the client goes away."""
        sink = self.loop.submit(rid, ids, params)
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(sink.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    self.loop.check()  # a request queued as the loop died is answered too
                    continue
                if item is None:
                    raise ApiError(503, "the server is shutting down", "server_error")
                if isinstance(item, EngineFailed):
                    raise item
                if isinstance(item, Exception):
                    raise ApiError(400, str(item))
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.loop.abort(rid)


def _chat_ids(tokenizer, messages: list[dict], add_special_tokens=False, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def build_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()
        server.tokenizing.shutdown()

    app = FastAPI(title="rlt-hal", version="0.1.0", lifespan=lifespan)
    _install_error_handlers(app)
    _install_routes(app, server)
    app.add_middleware(BodyLimit, max_bytes=server.max_request_bytes)
    return app


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


_UNION_BRANCHES = {"str", "int", "float", "bool", "none", "dict", "list"}


def _param(loc) -> str:
    """A pydantic error location as the field's name in the request: ``messages[0].content``
    (``body`` and the names pydantic gives a union's branches left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and "[" not in part and part not in _UNION_BRANCHES:
            out += f".{part}" if out else part
    return out


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, exc: RequestValidationError):
        err = exc.errors()[0]
        param = _param(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            return _json_error(400, "the request body is not valid JSON")
        if err.get("type") == "extra_forbidden":
            return _json_error(400, f"unknown field {param!r} is not supported", param=param)
        return _json_error(400, f"{param or 'body'}: {err.get('msg')}", param=param or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json_error(exc.status_code, str(exc.detail), kind)


def _install_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        server.loop.check()  # 503 once the engine loop has died: time to replace this server
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "rlt-hal",
            "max_model_len": server.llm.engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        server.check_auth(request)
        server.check_model(model_id)
        return card()

    async def handle(body, request: Request, respond, prefix: str):
        server.check_auth(request)
        server.check_model(body.model)  # before any tokenizing
        choices = server.prepare(body, await server.prompts(body))
        return await respond(server, body, choices, request, f"{prefix}-{uuid.uuid4().hex}")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handle(body, request, completion_response, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await handle(body, request, chat_response, "chatcmpl")

    install_tokenizer_routes(app, server)


def run(engine: EngineArgs, options: ServerArgs) -> int:
    """``rlt-hal serve`` on one device: uvicorn on ``host:port`` until SIGINT/SIGTERM, then the
    in-flight requests get ``shutdown_timeout`` seconds to finish, and those still running a
    503 ("the server is shutting down")."""
    import uvicorn

    options.check_single()
    sock = listening_socket(options.host, options.port)  # before minutes of loading
    llm = build_llm(engine, progress=True, announce=True)
    server = Server.from_args(llm, engine, options)
    print(
        f"serving {server.model_name!r} on http://{options.host}:{options.port}/v1 "
        f"({llm.driver.label})",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        build_app(server),
        host=options.host,
        port=options.port,
        log_level="info",
        # The engine loop answers what is left at shutdown_timeout (a 503 each); uvicorn
        # cancels handlers only if that did not end them a few seconds later.
        timeout_graceful_shutdown=options.shutdown_timeout + 5,  # type: ignore[arg-type]
    )
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal to the handler that was
    # installed before it; a no-op one there turns a graceful shutdown into exit status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # the first signal begins our drain too
            if not self.should_exit:
                server.begin_shutdown()
            super().handle_exit(sig, frame)

    Uvicorn(config).run(sockets=[sock])
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a port in use is reported at
    once rather than after the model has loaded; uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RuntimeError(
                f"--port {port}: {host}:{port} is already in use (another server?); stop it or "
                "choose another --port"
            ) from None
        raise RuntimeError(f"--host {host} --port {port}: cannot listen there ({exc})") from None
    sock.set_inheritable(True)
    return sock
