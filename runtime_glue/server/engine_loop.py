"""One thread owns the engine; HTTP handlers talk to it through queues only.

Handlers never touch device state: they submit requests (id, prompt ids, params, follows; a
request's choices in one command) and receive ``RequestUpdate`` objects on an asyncio queue
each; an abort is a message too. Errors from ``add_request`` come back on the same queue as an
exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time

from runtime_glue.engine.core import Engine
from runtime_glue.engine.request import RequestUpdate
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.server.metrics import Metrics
from runtime_glue.server.protocol import ApiError

logger = logging.getLogger(__name__)


class EngineFailed(ApiError):
    """The engine loop stopped on an error: this server cannot generate any more (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "server_error", code="engine_failed")


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        model = engine.model
        self.metrics = Metrics(
            engine.pool_blocks,
            model.cfg.total_ut_steps,
            weights=(model.plan.quantization, model.weight_bytes),
        )
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlt-hal-engine", daemon=True)
        self.failure: EngineFailed | None = None  # set once, if the loop dies
        self.draining = False  # shutting down: nothing new is admitted
        self._deadline: float | None = None  # then: when what still runs is ended

    def check(self) -> None:
        """Raise ``EngineFailed`` if the loop has died (health checks, request handlers)."""
        if self.failure is not None:
            raise self.failure

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    def drain(self, timeout: float) -> None:
        """Admit nothing more; requests still running ``timeout`` seconds from now are ended,
        their handlers answered with ``None`` (a 503: the server is shutting down)."""
        self.draining = True
        self._deadline = time.monotonic() + timeout
        self._commands.put(("wake",))

    def submit_all(self, requests: list[tuple[str, list[int], SamplingParams, str | None]]):
        """Queue requests (id, prompt ids, params, follows) as one command; returns the asyncio
        queues their outputs arrive on. ``follows``: a request earlier in the list with the same
        prompt, whose prompt pages this one shares (``Engine.add_request``); the loop adds them
        together, before any step, so a follower finds its leader still in prefill."""
        loop = asyncio.get_running_loop()
        sinks: list[asyncio.Queue] = [asyncio.Queue() for _ in requests]
        adds = [(*r, loop, sink) for r, sink in zip(requests, sinks, strict=True)]
        self._commands.put(("add", adds))
        return sinks

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        # A failed step fails its requests inside Engine.step; what escapes it (the device
        # lost while synchronising, a bug in scheduling) ends the loop. Every request waiting
        # on it then gets the error, and so do the handlers and health checks that ask later.
        try:
            self._serve()
        except Exception as exc:
            logger.exception("the engine loop stopped")
            self.failure = EngineFailed(
                f"the engine stopped on {type(exc).__name__}: {exc}; restart the server"
            )
            for rid in list(self._sinks):
                self._finish_metrics("error")
                self._send(rid, self.failure)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._end_all()
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self._deliver(out)
            self._snapshot()
        self._end_all()

    def _end_all(self) -> None:
        """Shutting down: end what is left; each handler answers 503."""
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            self._finish_metrics("abort")
            self._send(rid, None)
        for rid in list(self._sinks):  # queued, not yet added
            self._send(rid, None)
        self._snapshot()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            for rid, ids, params, follows, loop, sink in cmd[1]:
                self._sinks[rid] = (loop, sink)
                try:
                    self.engine.add_request(rid, ids, params, follows=follows)
                except ValueError as exc:
                    self._send(rid, exc)
                    continue
                self.metrics.prompt_tokens.inc(len(ids))
        elif cmd[0] == "abort":
            rid = cmd[1]
            if self.engine.abort_request(rid):
                self._finish_metrics("abort")
            self._sinks.pop(rid, None)

    def _deliver(self, out: RequestUpdate) -> None:
        self.metrics.generated_tokens.inc(len(out.new_token_ids))
        for step in out.exit_steps[len(out.exit_steps) - len(out.new_token_ids) :]:
            self.metrics.exit_step.observe(step)
        if out.finished:
            self._finish_metrics(out.finish_reason or "stop", out)
        self._send(out.request_id, out)

    def _finish_metrics(self, status: str, out: RequestUpdate | None = None) -> None:
        self.metrics.requests.labels(status).inc()
        if out is not None and out.first_token_time is not None:
            self.metrics.ttft.observe(out.first_token_time - out.arrival_time)
            if len(out.token_ids) > 1:
                decode = time.monotonic() - out.first_token_time
                self.metrics.tpot.observe(decode / (len(out.token_ids) - 1))

    def _send(self, rid: str, item) -> None:
        target = self._sinks.get(rid)
        if target is None:
            return
        if item is None or isinstance(item, Exception) or item.finished:
            self._sinks.pop(rid, None)
        loop, sink = target
        with contextlib.suppress(RuntimeError):  # the handler's event loop is gone
            loop.call_soon_threadsafe(sink.put_nowait, item)

    def _snapshot(self) -> None:
        eng = self.engine
        self.metrics.running.set(len(eng.running))
        self.metrics.waiting.set(len(eng.waiting))
        self.metrics.free_blocks.set(eng.num_free_blocks)
        self.metrics.cached_blocks.set(eng.allocator.num_cached)
        homes = len(eng.shared.homes) if eng.shared is not None else 0
        prompt_blocks = eng.allocator.num_in_use - homes - len(eng.reserved_blocks)
        self.metrics.blocks_in_use.labels("prompt").set(prompt_blocks)
        generated = eng.shared.num_in_use if eng.shared is not None else 0
        self.metrics.blocks_in_use.labels("generated").set(generated)
        self.metrics.sync_counters(eng.stats)
        while eng.speculator is not None and eng.speculator.accepted_per_verify:
            self.metrics.spec_accepted_per_verify.observe(
                eng.speculator.accepted_per_verify.popleft()
            )
