"""Turning engine outputs into OpenAI responses: whole, or streamed as server-sent events.

A request of several choices (``n > 1``, a batch of prompts, or both) runs one engine request
per choice; OpenAI's ``index`` of prompt ``i``'s sample ``j`` is ``i * n + j``. A stream
interleaves the choices' chunks as they come, each chunk carrying one choice and its index, as
vLLM's do. Usage counts each prompt's tokens once, however many choices it has, and every
choice's generated tokens (vLLM's rule).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import attrs
from fastapi.responses import StreamingResponse

from runtime_glue.engine.request import RequestOutput
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.server.protocol import ApiError, error_body


@attrs.frozen(eq=False)
class Choice:
    """One choice of an OpenAI request: one engine request."""

    index: int  # OpenAI's: prompt * n + sample
    prompt: int  # which of the request's prompts
    ids: list[int]
    params: SamplingParams


def plan_choices(prompts: list[list[int]], params: SamplingParams, n: int) -> list[Choice]:
    """``n`` choices per prompt. With a seed, sample ``j`` runs with ``seed + j`` (as vLLM's
    parallel sampling does): reproducible, and different from its siblings; greedy choices
    are all the same."""
    choices = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            seeded = params if params.seed is None else attrs.evolve(params, seed=params.seed + j)
            choices.append(Choice(i * n + j, i, ids, seeded))
    return choices


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _total_usage(choices: list[Choice], outs: dict[int, RequestOutput]) -> dict:
    prompts = {c.prompt: len(c.ids) for c in choices}  # once per prompt
    generated = sum(len(out.token_ids) for out in outs.values())
    return _usage(sum(prompts.values()), generated)


def _stable_text(text: str, finished: bool) -> str:
    """Hold back a trailing replacement char: the next token may complete the character."""
    return text if finished or not text.endswith("\ufffd") else text.rstrip("\ufffd")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Shape:
    """What differs between /v1/completions and /v1/chat/completions. ``logprobs``: the
    choice's, in its endpoint's shape, once the engine returns them."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs=None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        first: bool = False,
        logprobs=None,
    ) -> dict:
        if self.chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        text = text or ""
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


async def _merged(
    server, choices: list[Choice], rid: str, request
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Every choice's engine outputs, as they come. Ending early (an error, a client gone)
    aborts the engine requests still running (``Server.outputs``)."""
    if len(choices) == 1:
        async for out in server.outputs(rid, choices[0].ids, choices[0].params, request):
            yield choices[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            rid_i = f"{rid}-{choice.index}"
            async for out in server.outputs(rid_i, choice.ids, choice.params, request):
                queue.put_nowait((choice, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((choice, exc))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _respond(server, body, choices: list[Choice], request, rid: str, shape: _Shape):
    head = {"id": rid, "created": int(time.time()), "model": server.model_name}
    outputs = _merged(server, choices, rid, request)
    if body.stream:
        stream = _Stream(shape, head, choices, body)
        return StreamingResponse(stream.events(outputs), media_type="text/event-stream")
    finals: dict[int, RequestOutput] = {}
    async for choice, out in outputs:
        if out.finished:
            finals[choice.index] = out
    if len(finals) < len(choices):  # the client went away; nobody reads this
        raise ApiError(499, "client disconnected")
    results = []
    for choice in choices:
        out = finals[choice.index]
        if out.finish_reason == "error":
            raise ApiError(500, f"generation failed: {out.error}", "server_error")
        result = shape.choice(choice.index, out.text, out.finish_reason)
        if body.return_exit_steps:
            result["exit_steps"] = list(out.exit_steps)
        results.append(result)
    usage = _total_usage(choices, finals)
    return {**head, "object": shape.object, "choices": results, "usage": usage}


class _Progress:
    """What one choice of a stream has sent so far."""

    def __init__(self) -> None:
        self.text, self.exit_steps = "", 0
        self.last: RequestOutput | None = None

    def advance(self, out: RequestOutput) -> str:
        """The text ``out`` adds to what was sent (held back while a character is split)."""
        self.last = out
        text = _stable_text(out.text, out.finished)
        if not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


class _Stream:
    def __init__(self, shape: _Shape, head: dict, choices: list[Choice], body) -> None:
        self.shape, self.choices, self.body = shape, choices, body
        self.chunk = {**head, "object": shape.chunk_object}
        self.progress = {c.index: _Progress() for c in choices}

    def _event(self, choice: Choice, payload: dict, completion_tokens: int) -> str:
        event = {**self.chunk, "choices": [payload]}
        if self.body.continuous_usage:
            event["usage"] = _usage(len(choice.ids), completion_tokens)
        return _sse(event)

    async def events(self, outputs) -> AsyncIterator[str]:
        if self.shape.chat:  # each choice opens with its role, as OpenAI's and vLLM's do
            for c in self.choices:
                yield self._event(c, self.shape.delta(c.index, "", None, first=True), 0)
        try:
            async for choice, out in outputs:
                if out.finish_reason == "error":
                    yield _sse(error_body(f"generation failed: {out.error}", "server_error"))
                    break
                event = self._chunk(choice, out)
                if event is not None:
                    yield event
        except ApiError as exc:
            yield _sse(exc.body())
        finals = {i: p.last for i, p in self.progress.items() if p.last is not None}
        if self.body.include_usage and finals:
            usage = _total_usage(self.choices, finals)
            yield _sse({**self.chunk, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    def _chunk(self, choice: Choice, out: RequestOutput) -> str | None:
        progress = self.progress[choice.index]
        delta = progress.advance(out)
        if not delta and not out.finished:
            return None
        reason = out.finish_reason if out.finished else None
        payload = self.shape.delta(choice.index, delta, reason)
        if self.body.return_exit_steps:  # the tokens' loops since the last chunk
            payload["exit_steps"] = list(out.exit_steps[progress.exit_steps :])
            progress.exit_steps = len(out.exit_steps)
        return self._event(choice, payload, len(out.token_ids))


async def completion_response(server, body, choices, request, rid):
    return await _respond(server, body, choices, request, rid, _Shape(chat=False))


async def chat_response(server, body, choices, request, rid):
    return await _respond(server, body, choices, request, rid, _Shape(chat=True))
