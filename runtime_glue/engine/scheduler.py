"""The scheduler: which requests a step runs, how many of their tokens, with which pages.

FCFS admission with the prefix cache, pages taken as tokens cross into them, the newest
running request preempted when none can be had (``runtime_glue.engine.core`` describes the
rules), rows ordered prompt, generated, draft, verify. It owns the waiting and running queues
and the requests' pages, and emits each step's plan (``runtime_glue.engine.step.Scheduled``);
speculation tells it which rows a request runs (``Speculator.entry``), and the KV placement
what a request's positions take from the pool (``kv_placement``). :class:`EngineConfig`: the
budgets it schedules by."""

from __future__ import annotations

from collections import deque

import attrs
import torch

from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.kv_placement import KVPlacement
from runtime_glue.engine.request import Request, Status
from runtime_glue.engine.speculative import Entry, Speculator
from runtime_glue.engine.step import Scheduled


@attrs.frozen
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    prefill_chunk_size: int | None = None  # None: full prefill
    enable_prefix_caching: bool = False
    depth_batching: bool = False  # a generated token's loops in separate steps, one a step
    depth_exits: bool = False  # and it leaves after the loop its exit rule reaches (adaptive)

    def __attrs_post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode"
            )
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")


class Scheduler:
    """Scheduling and page management of the engine's requests."""

    def __init__(
        self,
        config: EngineConfig,
        allocator: BlockAllocator,
        kv: KVPlacement,
        speculator: Speculator | None,
        stats: dict[str, int],
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.kv = kv
        self.speculator = speculator
        self.stats = stats  # the engine's counters: preemptions, prefix-cache queries and hits
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.device = torch.device("cpu")  # where slot indices for KV copies live (the engine's)

    def schedule(self) -> list[Scheduled]:
        """The next step's plan, in row order; [] when nothing can run now."""
        plan = [self._scheduled(req, n, entry) for req, n, entry in self._schedule()]
        return sorted(plan, key=lambda s: s.loop is not None)  # depth rows last (stable)

    def _scheduled(self, req: Request, n: int, entry: Entry | None) -> Scheduled:
        """Under depth-wise batching a generated token (one pending row) runs one loop a step:
        the loop after the last one its token ran (docs/depth-batching.md)."""
        loops = self.kv.loops
        one = entry is None and n == 1 and req.num_computed + 1 == req.num_tokens
        if not (self.config.depth_batching and loops > 1 and one and not req.in_prefill):
            return Scheduled(req=req, n=n, entry=entry)
        loop = req.depth.loop if req.depth is not None else 0
        finishing = loop == loops - 1
        exits = self.config.depth_exits and req.exit_mode.kind == "threshold"  # as adaptive's
        return Scheduled(
            req=req, n=n, loop=loop, finishing=finishing, may_exit=exits and not finishing
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of its queue and release its pages (it finished or was aborted)."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        self.kv.release(req, req.last_fence)

    def _schedule(self) -> list[tuple[Request, int, Entry | None]]:
        """(request, rows, speculative entry) of the next step: each entry computed once."""
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[Request, int, Entry | None]] = []
        preemptions = self.stats["preemptions"]
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted for an older request in this loop
            entry = self.entry(req)
            n = self._chunk(req, budget) if entry is None else entry.n * (entry.n <= budget)
            start = req.num_computed if entry is None else entry.ctx
            if n and self._pages_for(req, start + n):
                plan.append((req, n, entry))
                budget -= n
        if self.stats["preemptions"] != preemptions:
            return self._ordered(plan)  # the pool ran dry: admit no one this step
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if not self._admit(req):
                break  # FCFS: later requests wait behind this one
            n = self._chunk(req, budget)
            if not n:
                break
            plan.append((req, n, None))  # a request starts in prefill: no round yet
            budget -= n
        return self._ordered(plan)

    @staticmethod
    def _ordered(plan: list[tuple[Request, int, Entry | None]]):
        # Prompt positions first: the execution plan may run them on other kernels than
        # generated positions (runtime_glue.ouro.plan), and a step's prompt rows form one block.
        # Drafting and verifying rows follow (runtime_glue.engine.speculative).
        plan = [p for p in plan if p[0].status is Status.RUNNING]  # not preempted since
        return sorted(plan, key=lambda p: Speculator.order(p[0], p[2]))

    def entry(self, req: Request) -> Entry | None:
        """The rows ``req`` drafts or verifies next; None for an ordinary step."""
        return None if self.speculator is None else self.speculator.entry(req)

    def trim(self, req: Request, tokens: int, fence) -> None:
        """Free ``req``'s pages past its first ``tokens`` positions (a verify step's rejected
        drafts: ``Speculator.apply`` says how many positions it keeps)."""
        self.kv.trim(req, tokens, fence)

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of ``req``'s pending tokens this step computes (0: none fits). A chunk
        never mixes prompt and generated positions: they may run on other kernels."""
        start, chunk = req.num_computed, self.config.prefill_chunk_size
        end = req.num_tokens if start >= len(req.prompt_ids) else len(req.prompt_ids)
        pending = end - start
        limit = self.kv.chunk_limit(req)
        if limit is not None:
            return min(limit, pending, budget)
        if chunk is None and req.in_prefill:
            return pending if pending <= budget else 0  # full prefill, or not this step
        return min(pending, chunk or pending, budget)

    def _pages_for(self, req: Request, tokens: int) -> bool:
        """Give ``req`` pages for its first ``tokens`` positions, preempting the newest running
        requests while none can be had; False if ``req`` itself was preempted."""
        while not self.kv.take(req, tokens):
            if self.kv.num_pending:  # a finished request's pages, still fenced
                self.kv.reclaim(wait=True)
                if self.kv.take(req, tokens):
                    return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Release ``req``'s pages and queue it first, to be recomputed from its cached prefix."""
        self.running.remove(req)
        self.kv.release(req, req.last_fence)
        req.num_computed, req.registered = 0, 0
        req.spec = None  # its drafts go; it is recomputed from its verified tokens
        req.depth = None  # and a token part-way through its loops starts again
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def _admit(self, req: Request) -> bool:
        """Start ``req`` with the pages of its prompt (and of its generated tokens, when it was
        preempted): cached ones shared, the others fresh. False if they cannot be had now, or
        only by leaving less than a page for each running request to grow into."""
        cached: list[int] = []
        if self.config.enable_prefix_caching and req.params.prompt_logprobs is None:
            # The last prompt token is always computed: its logits give the first new token.
            # (A request scoring its prompt computes every position: a hit has no logits.)
            usable = (len(req.prompt_ids) - 1) // self.allocator.block_size
            cached = self.allocator.cached_prefix(req.block_hashes[:usable])
            self.stats["prefix_cache_queries"] += usable * self.allocator.block_size
        self.allocator.share(cached)  # before allocating, so none of them is evicted
        if not self.kv.admit(req, cached, len(self.running)):
            self.allocator.free_after(cached, None)
            return False
        self.waiting.popleft()
        req.num_computed = req.registered = len(cached) * self.allocator.block_size
        self.stats["prefix_cache_hits"] += req.num_computed
        req.status = Status.RUNNING
        self.running.append(req)
        return True

    def fork(self, req: Request, leader: Request, copy) -> bool:
        """Start ``req`` (the same prompt, n > 1) on ``leader``'s computed prompt: its full
        pages shared, read-only and counted; its partial last page copied into a fresh one
        (``copy(src_slots, dst_slots)``, every plane). False when no page or no running slot
        can be had now (``req`` is then computed as any request)."""
        bs, n = self.allocator.block_size, leader.num_computed
        full, partial = divmod(n, bs)
        if len(self.running) >= self.config.max_num_seqs:
            return False
        fresh = self.allocator.allocate(1) if partial else []
        if fresh is None:
            return False
        shared = leader.blocks[:full]
        self.allocator.share(shared)
        if partial:
            src = leader.blocks[full] * bs + torch.arange(partial)
            copy(src.to(self.device), fresh[0] * bs + torch.arange(partial).to(self.device))
        req.blocks, req.gen_blocks = shared + fresh, []
        req.num_computed = n
        req.registered = min(leader.registered, full * bs)
        req.status = Status.RUNNING
        self.running.append(req)
        return True

    def register_prompt_blocks(self, req: Request) -> None:
        """Offer the prompt's blocks this step filled to the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.allocator.block_size
        full = min(req.num_computed, len(req.prompt_ids)) // bs
        for i in range(req.registered // bs, full):
            self.allocator.register(req.blocks[i], req.block_hashes[i])
        req.registered = max(req.registered, full * bs)
