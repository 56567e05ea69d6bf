"""Tokenizing and chat templating off the event loop, in bounded thread pools.

A large prompt takes seconds to tokenize (8 MB: 12 s on a 2-core EPYC); on the event loop it
would stall every other request and ``/health`` meanwhile. Text of ``LARGE`` characters or
more goes to a lane of one thread, so large prompts queue behind each other, never in front
of short ones, and at most one at a time holds the memory its tokenization takes; shorter text
goes to a lane of a few threads. Each thread has its own tokenizer: a fast tokenizer must not
be used from two threads at once ("Already borrowed"), and the engine thread decodes with
another.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from runtime_glue.engine.tokenizer import load_tokenizer

T = TypeVar("T")

LARGE = 1 << 16  # characters


class Tokenizing:
    def __init__(self, model_dir: str | Path, workers: int = 2) -> None:
        self.model_dir = model_dir
        self._local = threading.local()
        self._short = ThreadPoolExecutor(workers, thread_name_prefix="rlt-hal-tokenize")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="rlt-hal-tokenize-large")
        self.tokenizer = load_tokenizer(model_dir)  # for the event loop's cheap questions

    def _own(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = load_tokenizer(self.model_dir)
        return tok

    async def run(self, size: int, fn: Callable[[Any], T]) -> T:
        """``fn(tokenizer)`` on a pool thread with a tokenizer of its own; ``size``: the
        characters of text it tokenizes, which chooses the lane."""
        lane = self._large if size >= LARGE else self._short
        return await asyncio.get_running_loop().run_in_executor(lane, lambda: fn(self._own()))

    def shutdown(self) -> None:
        for pool in (self._short, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
