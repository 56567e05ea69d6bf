"""What a long training prints while it runs, on standard error: its phases, then its steps.

The steps show as a tqdm bar (step, loss, ETA) where standard error is a terminal that reports
its width. Elsewhere (a pipe, a log file, a CI console, a pty that reports zero columns, where
tqdm would draw an empty bar) they show as a plain line every ``every_s`` seconds, and at the
first and the last step: ``step 120/500, loss 5.123, 1m32s elapsed, ETA 4m50s``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any


def duration(seconds: float) -> str:
    """``0.4s``, ``42s``, ``7m32s``, ``1h05m``."""
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def terminal_columns(stream: IO[str]) -> int:
    """The width the terminal behind ``stream`` reports; 0 when it is not a terminal or reports
    none (a pty without a size: ``script``, some IDE and CI consoles)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (OSError, ValueError, AttributeError):  # no file descriptor behind it (StringIO)
        return 0


class TrainingProgress:
    """Phases (``phase``), steps (``start``, ``step``, ``close``) and the elapsed time of a
    training run; ``enabled=False`` prints nothing. ``stream``: standard error as it is when
    a line is printed (default)."""

    def __init__(
        self,
        phases: int = 4,
        enabled: bool = True,
        stream: IO[str] | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.phases, self.enabled, self._stream = phases, enabled, stream
        self.every_s, self.clock = every_s, clock
        self.started = clock()
        self._phase = 0
        self._bar: Any = None
        self._total = 0
        self._steps_started = self._last_line = 0.0

    @property
    def stream(self) -> IO[str]:
        return self._stream or sys.stderr

    def elapsed(self) -> float:
        return self.clock() - self.started

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def phase(self, name: str, what: str) -> None:
        """``[2/4] tokenizer: what``, the next phase begun."""
        self._phase += 1
        self.say(f"[{self._phase}/{self.phases}] {name}: {what}")

    def start(self, total: int, desc: str = "training") -> None:
        """``total`` steps begin: a bar on a sized terminal, else plain lines."""
        self._total, self._steps_started = total, self.clock()
        self._last_line = self._steps_started
        if self.enabled and terminal_columns(self.stream) > 0:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, file=self.stream, mininterval=1, dynamic_ncols=True
            )

    def step(self, step: int, loss: float) -> None:
        """Step ``step`` (0-based) finished with ``loss``."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self._bar.update(1)
            return
        now, done = self.clock(), step + 1
        if done in (1, self._total) or now - self._last_line >= self.every_s:
            self._last_line = now
            spent = now - self._steps_started
            eta = spent / done * (self._total - done)
            self.say(
                f"  step {done}/{self._total}, loss {loss:.3f}, {duration(spent)} elapsed, "
                f"ETA {duration(eta)}"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
