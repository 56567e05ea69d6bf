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

from runtime_glue.engine.request import RequestUpdate
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.server.protocol import ApiError
from runtime_glue.server.render import Choice, Progress, Render


def plan_choices(prompts: list[list[int]], params: SamplingParams, n: int) -> list[Choice]:
    """``n`` choices per prompt: sample 0 computes the prompt, samples 1..n-1 follow it (share
    its KV pages, ``Engine.add_request(follows=...)``). With a seed, sample ``j`` runs with
    ``seed + j`` (as vLLM's parallel sampling does): reproducible, and different from its
    siblings; greedy choices are all the same."""
    choices = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            seeded = params if params.seed is None else attrs.evolve(params, seed=params.seed + j)
            choices.append(Choice(i * n + j, i, ids, seeded, None if j == 0 else i * n))
    return choices


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _total_usage(
    choices: list[Choice], outs: dict[int, RequestUpdate], render: Render | None = None
) -> dict:
    prompts = {c.prompt: len(c.ids) for c in choices}  # once per prompt
    generated = sum(len(out.token_ids) for out in outs.values())
    usage = _usage(sum(prompts.values()), generated)
    if render is not None and render.reasoning is not None:  # vLLM's, with a reasoning parser
        thought = sum(render.reasoning_tokens(out) for out in outs.values())
        usage["completion_tokens_details"] = {"reasoning_tokens": thought}
    return usage


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def merged_outputs(
    server, choices: list[Choice], rid: str, request
) -> AsyncIterator[tuple[Choice, RequestUpdate]]:
    """Every choice's engine outputs, as they come. All are submitted at once, in order (a
    follower after the choice it follows). Ending early (an error, a client gone) aborts the
    engine requests still running (``Server.outputs``)."""
    if len(choices) == 1:
        (sink,) = server.submit([(rid, choices[0].ids, choices[0].params, None)])
        async for out in server.outputs(rid, sink, request):
            yield choices[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, sink) -> None:
        try:
            async for out in server.outputs(f"{rid}-{choice.index}", sink, request):
                queue.put_nowait((choice, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((choice, exc))
        finally:
            queue.put_nowait((choice, None))

    sinks = server.submit(
        [
            (
                f"{rid}-{c.index}",
                c.ids,
                c.params,
                None if c.follows is None else f"{rid}-{c.follows}",
            )
            for c in choices
        ]
    )
    tasks = [asyncio.create_task(pump(c, sink)) for c, sink in zip(choices, sinks, strict=True)]
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


async def respond(
    server, body, choices: list[Choice], request, rid: str, render: Render, shown: str
):
    """The response (or stream) of a request whose choices run as engine requests ``rid``
    (``rid-i`` for several); ``shown``: its ``id``."""
    head = {"id": shown, "created": int(time.time()), "model": server.model_name}
    outputs = merged_outputs(server, choices, rid, request)
    if body.stream:
        stream = ChunkStream(render, head, choices, body)
        return StreamingResponse(stream.events(outputs), media_type="text/event-stream")
    finals: dict[int, RequestUpdate] = {}
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
        results.append(render.choice(choice, out))
    usage = _total_usage(choices, finals, render)
    response = {**head, "object": render.object, "choices": results, "usage": usage}
    return {**response, **render.extras(finals)}


class ChunkStream:
    """A request's stream: each choice's chunk payloads as they come (``payloads``), which
    ``events`` sends as chat or completions SSE chunks (and /v1/responses translates into its
    own events)."""

    def __init__(self, render: Render, head: dict, choices: list[Choice], body) -> None:
        self.render, self.choices, self.body = render, choices, body
        self.chunk = {**head, "object": render.chunk_object}
        self.progress = {
            c.index: Progress(render.tools, render.reasoning, render.opened) for c in choices
        }

    def _event(self, choice: Choice, payload: dict, completion_tokens: int) -> str:
        event = {**self.chunk, "choices": [payload]}
        if self.body.continuous_usage:
            event["usage"] = _usage(len(choice.ids), completion_tokens)
        return _sse(event)

    async def payloads(self, outputs) -> AsyncIterator[tuple[Choice, dict, int]]:
        """(choice, chunk payload, its completion tokens so far), chat's role first; a failed
        generation raises ``ApiError`` (500)."""
        for c in self.choices:
            opening = self.render.opening(c)
            if opening is not None:
                yield c, opening, 0
        async for choice, out in outputs:
            if out.finish_reason == "error":
                raise ApiError(500, f"generation failed: {out.error}", "server_error")
            payload = self.render.delta(choice, out, self.progress[choice.index])
            if payload is not None:
                yield choice, payload, len(out.token_ids)

    def usage(self) -> dict | None:
        """The usage of what has finished (None if nothing has)."""
        finals = {i: p.last for i, p in self.progress.items() if p.last is not None}
        return _total_usage(self.choices, finals, self.render) if finals else None

    async def events(self, outputs) -> AsyncIterator[str]:
        try:
            async for choice, payload, tokens in self.payloads(outputs):
                yield self._event(choice, payload, tokens)
        except ApiError as exc:
            yield _sse(exc.body())
        usage = self.usage()
        if self.body.include_usage and usage is not None:
            yield _sse({**self.chunk, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
