"""Prometheus metrics (``prometheus_client``), updated by the engine loop thread and rendered
by ``GET /metrics``, with the process and platform collectors scrapers expect."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
END_STATES = ("stop", "length", "abort", "error")
SPEC_COUNTERS = {  # zero unless the server runs with --speculative-loops
    "spec_drafted": "Tokens drafted by speculative decoding (the first loops' choices)",
    "spec_accepted": "Drafted tokens the full depth accepted",
    "spec_verify_steps": "Verify steps of speculative decoding (one per round of drafts)",
}
SPEC_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 63.0)


class Metrics:
    """One server's metrics, in a registry of their own (prometheus_client is thread-safe)."""

    def __init__(
        self, total_blocks: int, loops: int = 4, weights: tuple[str, int] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        reg = self.registry
        self.requests = Counter(
            "rlt_hal_requests", "Requests ended, by how they ended", ["status"], registry=reg
        )
        for status in END_STATES:  # every state is scraped from the start, at 0
            self.requests.labels(status)
        self.generated_tokens = Counter(
            "rlt_hal_generated_tokens", "Tokens generated", registry=reg
        )
        self.prompt_tokens = Counter(
            "rlt_hal_prompt_tokens", "Prompt tokens accepted", registry=reg
        )
        self.running = Gauge("rlt_hal_running_requests", "Requests running", registry=reg)
        self.waiting = Gauge("rlt_hal_waiting_requests", "Requests waiting", registry=reg)
        self.free_blocks = Gauge(
            "rlt_hal_kv_free_blocks",
            "KV cache blocks that can be handed out (free, or cached and unused)",
            registry=reg,
        )
        self.blocks_in_use = Gauge(
            "rlt_hal_kv_blocks_in_use",
            "KV cache blocks in use, by kind: prompt blocks keep every plane; generated blocks "
            "(--kv-sharing last only) keep one plane per layer, loops of them to a pool block",
            ["kind"],
            registry=reg,
        )
        for kind in ("prompt", "generated"):
            self.blocks_in_use.labels(kind)
        self.cached_blocks = Gauge(
            "rlt_hal_kv_cached_blocks",
            "KV cache blocks holding a prefix-cache entry (in use or not)",
            registry=reg,
        )
        # The engine's running totals, mirrored by _sync_counters.
        self.engine_counters = {
            "prefix_cache_queries": Counter(
                "rlt_hal_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (as vLLM counts them)",
                registry=reg,
            ),
            "prefix_cache_hits": Counter(
                "rlt_hal_prefix_cache_hits",
                "Prompt tokens found in the prefix cache (not computed again)",
                registry=reg,
            ),
            "preemptions": Counter(
                "rlt_hal_preemptions",
                "Running requests preempted (pages released, recomputed later) when the pool "
                "ran dry",
                registry=reg,
            ),
            "forked": Counter(
                "rlt_hal_forked_requests",
                "Samples of an n > 1 request started on another's computed prompt (its KV pages "
                "shared, not computed again)",
                registry=reg,
            ),
            "depth_rows": Counter(
                "rlt_hal_depth_rows",
                "Loops run by depth-wise rows (--depth-batching): a generated token's loops, one "
                "a step",
                registry=reg,
            ),
        }
        for name, help in SPEC_COUNTERS.items():
            self.engine_counters[name] = Counter(f"rlt_hal_{name}", help, registry=reg)
        self._seen = dict.fromkeys(self.engine_counters, 0)
        if weights is not None:  # (scheme, bytes): "int4 (group 32)", the loaded bytes
            Gauge(
                "rlt_hal_weight_bytes",
                "Bytes the model's weights take as loaded, by weight scheme",
                ["scheme"],
                registry=reg,
            ).labels(weights[0]).set(weights[1])
        total = Gauge("rlt_hal_kv_total_blocks", "KV cache blocks in the pool", registry=reg)
        total.set(total_blocks)
        self.free_blocks.set(total_blocks)
        self.ttft = Histogram(
            "rlt_hal_time_to_first_token_seconds",
            "Time from a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "rlt_hal_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=TPOT_BUCKETS,
            registry=reg,
        )

        self.exit_step = Histogram(
            "rlt_hal_exit_step",
            "The loop (0-based) each generated token's logits came from",
            buckets=tuple(float(t) for t in range(loops)),
            registry=reg,
        )

        self.spec_accepted_per_verify = Histogram(
            "rlt_hal_spec_accepted_per_verify",
            "Drafts accepted by each verify step of speculative decoding (the acceptance "
            "histogram; a verify step also gives one full-depth token after them)",
            buckets=SPEC_BUCKETS,
            registry=reg,
        )

    def sync_counters(self, stats: dict[str, int]) -> None:
        """Advance the mirrored counters to the engine's totals."""
        for name, counter in self.engine_counters.items():
            counter.inc(stats.get(name, 0) - self._seen[name])
            self._seen[name] = stats.get(name, 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
