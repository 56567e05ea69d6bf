"""The app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics here;
/v1/responses (on the chat pipeline) in ``responses``; the tokenizer endpoints (/tokenize,
/detokenize, /tokenizer_info) and /version in ``tokenizer_api``."""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from runtime_glue.engine.args import EngineArgs
from runtime_glue.engine.core import InvalidRequest
from runtime_glue.engine.llm import build_llm
from runtime_glue.engine.reasoning import ThinkingTags, effort_budget
from runtime_glue.engine.request import RequestUpdate
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.structured import StructuredOutputError, StructuredSpec
from runtime_glue.engine.tokenizer import render_chat
from runtime_glue.server import DEFAULT_JSON_WHITESPACE, DEFAULT_MAX_REQUEST_BYTES
from runtime_glue.server.args import ServerArgs
from runtime_glue.server.engine_loop import EngineFailed, EngineLoop
from runtime_glue.server.http import BodyLimit, install_error_handlers
from runtime_glue.server.messages import MessageError, template_messages
from runtime_glue.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedValue,
    check_template_kwargs,
)
from runtime_glue.server.render import Choice, Render
from runtime_glue.server.responses import install_responses_routes
from runtime_glue.server.routes import plan_choices, respond
from runtime_glue.server.tokenizer_api import install_tokenizer_routes
from runtime_glue.server.tokenizing import Tokenizing
from runtime_glue.server.tools import ToolError, ToolPlan, plan_tools, renders_tools

logger = logging.getLogger(__name__)
request_log = logging.getLogger("rlt_hal.requests")  # --enable-log-requests


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
            json_whitespace=None if options.json_whitespace == "any" else options.json_whitespace,
            trust_request_chat_template=options.trust_request_chat_template,
            log_requests=options.enable_log_requests,
        )

    def __init__(
        self,
        llm,
        served_model_name: str,
        api_key: str | None = None,
        default_max_tokens: int = 16,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        shutdown_timeout: float = 10.0,
        json_whitespace: str | None = DEFAULT_JSON_WHITESPACE,
        trust_request_chat_template: bool = False,
        log_requests: bool = False,
    ) -> None:
        self.llm = llm
        self.reasoning = llm.reasoning  # --reasoning-parser, an engine option
        self.log_requests = log_requests
        if log_requests and not request_log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
            request_log.addHandler(handler)
            request_log.setLevel(logging.INFO)
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizing = Tokenizing(llm.model_dir)  # off the event loop, bounded
        self.renders_tools = renders_tools(self.tokenizing.tokenizer.chat_template)
        self.json_whitespace = json_whitespace
        self.shutdown_timeout = shutdown_timeout
        self.model_name = served_model_name
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.max_request_bytes = max_request_bytes
        self.loop = EngineLoop(llm.engine)
        self.created = int(time.time())

    def log_request(self, shown: str, body, choices) -> None:
        """One line for an admitted request (--enable-log-requests): who asked (OpenAI's
        ``user`` and ``metadata``) and what it asked for; never the prompt's text."""
        prompts = {c.prompt: len(c.ids) for c in choices}
        request_log.info(
            "request %s: user=%s metadata=%s prompt_tokens=%s n=%d max_tokens=%s stream=%s",
            json.dumps(shown), json.dumps(body.user), json.dumps(getattr(body, "metadata", None), sort_keys=True),
            list(prompts.values()), body.n, choices[0].params.max_tokens, body.stream,
        )  # fmt: skip

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

    async def prepare(
        self, body, prompts: list[list[int]], tools: ToolPlan | None = None
    ) -> list[Choice]:
        """The request's choices, every prompt validated (a grammar compiled) before any runs."""
        self.loop.check()  # a dead engine answers 503 before a response (or stream) begins
        if self.loop.draining:
            raise ApiError(503, "the server is shutting down", "server_error")
        try:
            body.check_supported()
            spec = self._structured(body, tools)
            params = body.sampling_params(self._default_max_tokens(body, prompts), spec)
            params = self._thinking_budget(body, params)
        except (UnsupportedValue, StructuredOutputError) as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ValueError as exc:  # SamplingParams' checks begin with the field's name
            name = str(exc).split(" ", 1)[0]
            param = name if name in type(body).model_fields else None
            raise ApiError(400, str(exc), param=param) from None
        if spec is None:
            self._validate(body, prompts, params)
        else:  # compiling a grammar takes a while: off the event loop
            await asyncio.to_thread(self._validate, body, prompts, params)
        return plan_choices(prompts, params, body.n)

    def _thinking_budget(self, body, params: SamplingParams) -> SamplingParams:
        """With a reasoning parser, a chat request's ``reasoning_effort`` bounds its thinking
        (``reasoning.EFFORT_BUDGETS``) unless it gives ``thinking_token_budget``; without one
        the field is accepted and changes nothing, as for any model that does not think."""
        effort = getattr(body, "reasoning_effort", None)
        if self.reasoning is None or effort is None or params.thinking_token_budget is not None:
            return params
        if isinstance(self.llm.engine.thinking_tags(), str):
            return params  # tags the engine cannot follow: no budget, as for any model
        try:
            budget = effort_budget(effort)
        except ValueError as exc:
            raise UnsupportedValue("reasoning_effort", str(exc)) from None
        return attrs.evolve(params, thinking_token_budget=budget)

    def _default_max_tokens(self, body, prompts: list[list[int]]) -> int:
        """A request's max_tokens where it gives none: completions, ``--default-max-tokens``;
        chat, what is left of the context its prompt may reach (vLLM's default)."""
        if not isinstance(body, ChatCompletionRequest):
            return self.default_max_tokens
        n = len(prompts[0])
        return max(self.llm.engine.request_capacity(n) - n, 1)

    def _structured(self, body, tools: ToolPlan | None) -> StructuredSpec | None:
        """The request's structured-output spec: a tool call's schema, or the one its
        ``response_format`` / ``structured_outputs`` asks for, JSON with the server's
        whitespace unless the request chose. A forced call's turn writes no message, so a
        ``response_format`` (its shape checked) waits for a later turn, as OpenAI's does (the Agents
        SDK sends both); ``structured_outputs`` shapes the whole output and cannot."""
        spec = body.structured()
        if tools is not None and (forced := tools.spec()) is not None:
            if body.structured_outputs is not None:
                raise UnsupportedValue(
                    "tool_choice",
                    f"tool_choice {tools.mode!r} is enforced with a schema of its own; it "
                    "cannot be combined with structured_outputs",
                )
            return forced
        if spec is not None and spec.kind == "json" and spec.whitespace is None:
            spec = attrs.evolve(spec, whitespace=self.json_whitespace)
        return spec

    def _validate(self, body, prompts: list[list[int]], params) -> None:
        batched = isinstance(body, CompletionRequest) and body.batched
        for i, ids in enumerate(prompts):
            try:
                self.llm.engine.validate(ids, params)
            except InvalidRequest as exc:
                if not batched:
                    raise ApiError(400, str(exc), param=exc.param) from None
                param = f"prompt[{i}]" if exc.param == "prompt" else exc.param
                raise ApiError(400, f"prompt[{i}]: {exc}", param=param) from None

    def tool_plan(self, body) -> ToolPlan | None:
        """A chat request's tools and tool_choice, checked against each other and the template."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        try:
            return plan_tools(
                body.tools, body.tool_choice, body.parallel_tool_calls, self.renders_tools
            )
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    async def prompts(self, body, tools: ToolPlan | None = None) -> list[list[int]]:
        """The request's prompts as token ids, tokenized (and templated) on pool threads."""
        if isinstance(body, ChatCompletionRequest):
            if body.chat_template is not None and not self.trust_request_chat_template:
                raise ApiError(
                    400,
                    "a chat template given with the request is used only by a server started "
                    "with --trust-request-chat-template (vLLM's rule)",
                    param="chat_template",
                )
            try:
                messages = template_messages(body.messages)
                check_template_kwargs(body.chat_template_kwargs)
            except (MessageError, UnsupportedValue) as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            kwargs = tools.template_kwargs() if tools is not None else {}
            return [await self.chat_ids(messages, **kwargs, **body.template_kwargs())]
        return list(await asyncio.gather(*(self.encode(p) for p in body.prompts())))

    async def prompt_texts(self, body, prompts: list[list[int]]) -> list[str] | None:
        """Each prompt as text, for ``echo`` (a token-id prompt decoded)."""
        if isinstance(body, ChatCompletionRequest) or not body.echo:
            return None
        texts = []
        for given, ids in zip(body.prompts(), prompts, strict=True):
            if not isinstance(given, str):
                given = await self.tokenizing.run(len(ids), _decoder(ids))
            texts.append(given)
        return texts

    def prompt_opens(self, ids: list[int]) -> bool | None:
        """Whether a chat prompt opened the reasoning block, closed it, or neither."""
        if self.reasoning is None:
            return None
        return self.reasoning.prompt_opens(self.tokenizing.tokenizer.decode, ids)

    def decode_one(self, token: int) -> str:
        return self.tokenizing.tokenizer.decode([token])

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
            return await self.tokenizing.run(
                size, lambda tok: render_chat(tok, messages, **kwargs)[1]
            )
        except (jinja2.TemplateError, ValueError) as exc:  # ValueError: transformers' checks
            raise ApiError(
                400, f"the chat template failed on these messages: {exc}", param="messages"
            ) from None

    def prewarm(self) -> None:
        """What the first request would otherwise wait for: the grammar engine's token table."""
        try:
            self.llm.engine.prewarm_grammars()
        except Exception as exc:  # noqa: BLE001 - the first structured request will say why
            logger.warning("structured outputs not prewarmed: %s", exc)

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM: admit nothing more; what runs gets ``shutdown_timeout`` seconds,
        then a 503 (``EngineLoop.drain``)."""
        self.loop.drain(self.shutdown_timeout)

    # -- running a request -----------------------------------------------------------------

    def submit(self, requests: list[tuple[str, list[int], SamplingParams, str | None]]):
        """Queue engine requests (id, prompt ids, params, follows) together; their sinks
        (``EngineLoop.submit_all``)."""
        return self.loop.submit_all(requests)

    async def outputs(self, rid: str, sink, request: Request) -> AsyncIterator[RequestUpdate]:
        """The engine's outputs for one submitted request; aborts it if the client goes away."""
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


def _decoder(ids: list[int]):
    return lambda tokenizer: tokenizer.decode(ids)


def build_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(server.prewarm)
        server.loop.start()
        yield
        server.loop.stop()
        server.tokenizing.shutdown()

    app = FastAPI(title="rlt-hal", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    _install_routes(app, server)
    app.add_middleware(BodyLimit, max_bytes=server.max_request_bytes)
    return app


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

    async def handle(body, request: Request, prefix: str, answer=respond):
        """Run a completions or chat request; ``answer`` turns its running choices into the
        response (``routes.respond``; /v1/responses has its own)."""
        server.check_auth(request)
        server.check_model(body.model)  # before any tokenizing
        tools = server.tool_plan(body)
        prompts = await server.prompts(body, tools)
        choices = await server.prepare(body, prompts, tools)
        chat = isinstance(body, ChatCompletionRequest)
        texts = await server.prompt_texts(body, prompts)
        opened = server.prompt_opens(prompts[0]) if chat else None
        tags = server.llm.engine.thinking_tags()
        end_id = tags.end if isinstance(tags, ThinkingTags) else None
        render = Render(
            chat, body, server.decode_one, texts, tools, server.reasoning, opened, end_id
        )
        rid = f"{prefix}-{uuid.uuid4().hex}"  # the engine's: unique whatever the client sends
        shown = f"{prefix}-{body.request_id}" if body.request_id else rid  # vLLM's request_id
        if server.log_requests:
            server.log_request(shown, body, choices)
        return await answer(server, body, choices, request, rid, render, shown)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handle(body, request, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await handle(body, request, "chatcmpl")

    install_responses_routes(app, server, handle)
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
