"""Prometheus metrics, updated by the engine loop thread and rendered by ``GET /metrics``."""

from __future__ import annotations

import threading
from collections import Counter

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self, name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        lines += [
            f'{name}_bucket{{le="+Inf"}} {self.n}',
            f"{name}_sum {self.total}",
            f"{name}_count {self.n}",
        ]
        return lines


class Metrics:
    def __init__(self, total_blocks: int) -> None:
        self.lock = threading.Lock()
        self.requests = Counter()  # by final status: stop, length, abort, error, rejected
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.running = 0
        self.waiting = 0
        self.free_blocks = total_blocks
        self.total_blocks = total_blocks
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def render(self) -> str:
        with self.lock:
            lines = ["# TYPE rlt_hal_requests_total counter"]
            for status in sorted(set(self.requests) | {"stop", "length", "abort", "error"}):
                lines.append(f'rlt_hal_requests_total{{status="{status}"}} {self.requests[status]}')
            for name, kind, value in (
                ("rlt_hal_generated_tokens_total", "counter", self.generated_tokens),
                ("rlt_hal_prompt_tokens_total", "counter", self.prompt_tokens),
                ("rlt_hal_running_requests", "gauge", self.running),
                ("rlt_hal_waiting_requests", "gauge", self.waiting),
                ("rlt_hal_kv_free_blocks", "gauge", self.free_blocks),
                ("rlt_hal_kv_total_blocks", "gauge", self.total_blocks),
            ):
                lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
            lines += self.ttft.render("rlt_hal_time_to_first_token_seconds")
            lines += self.tpot.render("rlt_hal_time_per_output_token_seconds")
        return "\n".join(lines) + "\n"
