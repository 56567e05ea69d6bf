"""The serving engine: FCFS scheduling, continuous batching, chunked prefill, request lifecycle.

Each ``step()`` batches one decode token for every running request that finished its prompt
with the next prompt chunk of requests still in prefill, under the ``max_num_seqs`` and
``max_num_batched_tokens`` budgets, runs the model once and samples.

Pages are taken as they are needed. Admission takes the pages of the prompt that the prefix
cache does not already hold (``kv_manager``); a request takes another page when its tokens
cross into it. When a running request needs a page and none can be had, the newest running
request is preempted: its pages are released and it waits at the head of the queue, to be
recomputed (its prompt, then its generated tokens as generated positions, so that in
deterministic mode it then produces exactly the tokens it would have).

The engine connects four seams, each a module of its own: the scheduler decides which
requests run which rows (``scheduler``: a plan of ``step.Scheduled``), the input builder turns
the plan into the step's inputs (``step``), the runner replays a captured graph of the step or
runs ``OuroModel.forward`` eagerly (``graphs``), and the engine samples (``sampler``) and
applies what each request's rows computed (``output``: tokens, stops, ``RequestUpdate``).
Speculative decoding (``speculative``) adds draft and verify rows through the scheduler and
the builder; where K/V lives (per depth, or shared decode KV) is one strategy the scheduler,
the validation and the builder ask (``kv_placement``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import attrs

from hal.graphs import StepGraphs
from hal.interfaces import Device
from runtime_glue.engine.depth_store import DepthStore
from runtime_glue.engine.detokenizer import IncrementalDetokenizer
from runtime_glue.engine.graphs import Replayed, StepGraphRunner, group_limits
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.kv_placement import KVPlacement, PerDepth
from runtime_glue.engine.output import Outputs, request_output
from runtime_glue.engine.reasoning import (
    ANSWER,
    ReasoningMatcher,
    ReasoningParser,
    ThinkingTags,
)
from runtime_glue.engine.request import Request, RequestUpdate, Status
from runtime_glue.engine.sampler import Sampled, Sampler
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.scheduler import EngineConfig, Scheduler
from runtime_glue.engine.shared_blocks import SharedBlocks
from runtime_glue.engine.speculative import SpeculativeConfig, Speculator
from runtime_glue.engine.step import HostStep, StepBuilder
from runtime_glue.engine.structured import GrammarCompiler
from runtime_glue.engine.validation import InvalidRequest as InvalidRequest
from runtime_glue.engine.validation import check_request, compile_grammar
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.model import OuroModel
from runtime_glue.ouro.plan import Admission

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: OuroModel,
        device: Device,
        allocator: BlockAllocator,
        config: EngineConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer=None,
        max_model_len: int | None = None,
        prefix_salt: bytes = b"",
        step_graphs: StepGraphs | None = None,
        kv: KVPlacement | None = None,
        speculative: SpeculativeConfig | None = None,
        grammars: Callable[[], GrammarCompiler] | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        """``prefix_salt``: what besides the tokens decides a block's K/V (the checkpoint, the
        execution plan); prefix-cache hashes start from it, so engines sharing one allocator
        under other plans never share a block. ``step_graphs``: capture decode-only steps
        and replay them (``runtime_glue.engine.graphs``). ``kv``: where requests' K/V lives
        (``runtime_glue.engine.kv_placement``; default: every plane of every position).
        ``speculative``: draft with the first loops. ``grammars``: makes the structured-output
        compiler, on first use (``runtime_glue.engine.structured``). ``reasoning``: a Thinking
        model's parser: grammars start after the reasoning, budgets bound it
        (``runtime_glue.engine.reasoning``)."""
        self.model = model
        self.prefix_salt = prefix_salt
        self.device = device
        self.allocator = allocator
        self.config = config = config or EngineConfig()
        cfg = model.cfg
        self.kv = kv or PerDepth(allocator, cfg.total_ut_steps, cfg.num_hidden_layers)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.stats = {
            "finished": 0,
            "aborted": 0,
            "failed": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "prefix_cache_queries": 0,  # prompt tokens looked up in the prefix cache
            "prefix_cache_hits": 0,  # of those, tokens found there
            "forked": 0,  # requests started on another's computed prompt (n > 1)
            "depth_rows": 0,  # loops run by depth-wise rows (--depth-batching)
        }
        self.speculator = self._speculator(speculative)
        self.scheduler = Scheduler(config, allocator, self.kv, self.speculator, self.stats)
        self.scheduler.device = device.torch_device
        early = None if speculative is None else speculative.loops
        depth = None
        if config.depth_batching and cfg.total_ut_steps > 1:  # (one loop: no depth rows)
            depth = DepthStore(config.max_num_seqs, cfg.total_ut_steps, cfg.hidden_size,
                               model.embed.dtype, device.torch_device,
                               config.depth_exits)  # fmt: skip
        self.builder = StepBuilder(model.cfg, self.kv, early, depth)
        self.graphs: StepGraphRunner | None = None
        self.graph_admission: Admission | None = None  # the graphs' check on this device
        if step_graphs is not None:
            self._start_graphs(step_graphs, speculative)
        self.sampler = Sampler(device, frozenset(eos_token_ids), tokenizer)
        self.output = Outputs(self.sampler, self.stats, self._finish)
        self.followers: dict[str, list[Request]] = {}  # n > 1: leader id -> who waits on it
        self._grammars = grammars
        self._compiler: GrammarCompiler | None = None
        self.reasoning = reasoning
        self._tags: ThinkingTags | str | None = None
        self._told_tags = False

    def _speculator(self, speculative: SpeculativeConfig | None) -> Speculator | None:
        if speculative is None:
            return None
        speculator = Speculator(speculative, self.model.cfg.total_ut_steps)
        self.stats.update(speculator.stats)
        return speculator

    def _start_graphs(self, graphs: StepGraphs, speculative: SpeculativeConfig | None) -> None:
        limits = group_limits(
            self.config.max_num_seqs,
            None if speculative is None else speculative.tokens,
            self.builder.depth is not None,
        )
        runner = StepGraphRunner(
            graphs, self.model, self.device, self.allocator, self.builder, limits,
            self.max_model_len,
        )  # fmt: skip
        self.graph_admission = runner.admit()
        if self.graph_admission.admitted:
            self.graphs = runner
            return
        logger.warning("step graphs refused: %s", self.graph_admission.why)
        self.allocator.release_reserved(self.device.record_fence())

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that stop a request (unless ``ignore_eos``), as the sampler bans them before
        ``min_tokens``: one set, the sampler's (a structured request's grammar has its own)."""
        return self.sampler.eos

    # -- what the scheduler holds ----------------------------------------------------------

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def shared(self) -> SharedBlocks | None:
        """The generated blocks' allocator of the KV placement, if it has one."""
        return self.kv.generated

    @property
    def reserved_blocks(self) -> list[int]:
        """Pages no request can have: the step graphs' scratch, of every engine on the pool."""
        return self.allocator.reserved

    @property
    def pool_blocks(self) -> int:
        """The blocks requests can have: the pool less the graphs' scratch."""
        return self.allocator.num_blocks - len(self.reserved_blocks)

    @property
    def pool_tokens(self) -> int:
        return self.pool_blocks * self.allocator.block_size

    def request_capacity(self, prompt_len: int) -> int:
        """The most tokens (prompt + output) a request with a prompt of ``prompt_len`` can
        ever reach here: ``max_model_len``, or less where the KV pool holds less (``prompt_len``
        where it cannot hold even the prompt)."""
        fits = lambda t: self.kv.pool_refusal(prompt_len, t, self.pool_blocks) is None  # noqa: E731
        lo, hi = prompt_len, self.max_model_len
        if hi <= lo or not fits(lo):
            return lo
        while lo < hi:  # the largest t in [lo, hi] that fits (fits is monotone)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # -- lifecycle -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest for a request that could never run here ("never", not
        "not now"). Every entry point (engine, LLM, server) checks through this one method."""
        check_request(self, prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        return_logits: bool = False,
        follows: str | None = None,
    ) -> None:
        """Queue a request. ``follows``: the id of a live request with the same prompt (n > 1):
        this one waits for that prompt's K/V, then shares its pages (``Scheduler.fork``) and
        chooses its first token from the same logits with its own seed."""
        params = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already live")
        self.validate(prompt_token_ids, params)
        req = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            params,
            return_logits,
            arrival_time=time.monotonic(),
        )
        if not params.greedy:
            req.seed = params.seed if params.seed is not None else secrets.randbits(62)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output,
                params.skip_special_tokens,
            )  # fmt: skip
        if self.config.enable_prefix_caching:
            salt = self.prefix_salt + b"|" + (params.cache_salt or "").encode()
            req.block_hashes = self.allocator.block_hashes(req.prompt_ids, salt)
        own = ExitMode(params.exit_at_step, params.exit_threshold, params.weighted_exit)
        req.exit_mode = own.or_default(self.model.plan.exit_defaults)
        req.matcher = self._matcher(req)
        self.requests[request_id] = req
        leader = self.requests.get(follows) if follows is not None else None
        if leader is not None and leader.prompt_ids == req.prompt_ids and leader.in_prefill:
            req.follows = follows
            self.followers.setdefault(leader.request_id, []).append(req)
        else:
            self.scheduler.waiting.append(req)

    def _matcher(self, req: Request):
        """A request's mask: its grammar (the compiler is made on first use), from the end of
        the reasoning with a reasoning parser, and its thinking budget. Tags that are not
        single tokens (a checkpoint without a Thinking tokenizer): the grammar from the first
        token, as without a parser (validate refuses a budget there)."""
        params, inner = req.params, None
        if params.structured_outputs is not None:
            compiler = self.grammar_compiler()
            compiled = compile_grammar(compiler, params)
            assert compiler is not None and compiled is not None
            inner = compiler.matcher(compiled)
        if self.reasoning is None or (inner is None and params.thinking_token_budget is None):
            return inner
        tags = self.thinking_tags()
        if not isinstance(tags, ThinkingTags):
            if not self._told_tags:  # once: the same for every request
                logger.warning("--reasoning-parser: grammars from the first token: %s", tags)
                self._told_tags = True
            return inner
        begins = self.reasoning.begins(
            self.reasoning.prompt_opens(self.tokenizer.decode, req.prompt_ids)
        )
        if begins == ANSWER:  # the prompt closed the block: nothing to follow
            return inner
        return ReasoningMatcher(
            tags, begins, self.model.cfg.vocab_size, sorted(self.eos_token_ids), inner,
            params.thinking_token_budget,
        )  # fmt: skip

    def thinking_tags(self) -> ThinkingTags | str | None:
        """The reasoning parser's tags as this tokenizer's ids, or why they cannot be followed
        (None without a parser)."""
        if self._tags is None and self.reasoning is not None:
            if self.tokenizer is None:
                self._tags = "the engine has no tokenizer (build it with LLM)"
            else:
                self._tags = ThinkingTags.of(self.reasoning, self.tokenizer)
        return self._tags

    def grammar_compiler(self) -> GrammarCompiler | None:
        """The structured-output compiler (made on first use), or None without a tokenizer."""
        if self._compiler is None and self._grammars is not None:
            self._compiler = self._grammars()
        return self._compiler

    def prewarm_grammars(self) -> None:
        """Build the grammar engine's token table now (0.3 s at 49k tokens), so that the first
        structured request does not wait for it; a server calls it at start, off its event loop."""
        compiler = self.grammar_compiler()
        if compiler is not None:
            compiler.ll_tokenizer()

    def abort_request(self, request_id: str) -> bool:
        """End a live request in any state and free its pages; False if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        self.stats["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def audit_pages(self) -> None:
        """Check the allocator against the running requests' block tables (tests, debugging)."""
        self.kv.audit(self.running, self.reserved_blocks)

    @property
    def num_free_blocks(self) -> int:
        self.allocator.reclaim()
        return self.allocator.num_free

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        waiting = self.followers.get(req.follows or "", [])
        if req in waiting:  # it waited on a leader: in no queue, holding no page
            waiting.remove(req)
        else:
            self.scheduler.remove(req)
        for follower in self.followers.pop(req.request_id, []):  # a leader gone too early
            follower.follows = None
            self.scheduler.waiting.append(follower)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        self.requests.pop(req.request_id, None)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        plan = self.scheduler.schedule()
        if not plan and self.waiting and not self.running:
            self.kv.reclaim(wait=True)  # pages behind a fence: wait for them
            plan = self.scheduler.schedule()
            if not plan:  # the whole pool is this request's, and it still does not fit
                return [self._never_fits(self.waiting[0])]
        if not plan:
            return []
        try:
            host = self.builder.build(plan)
            result = self._run(host)
            fence = self.device.record_fence()
            leads = any(s.req.request_id in self.followers for s in plan)
            sampled = self.sampler.sample(result, host, force_logits=leads)
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("step %d failed", self.num_steps)
            self.device.synchronize()  # nothing of the step may still be using its pages
            for s in plan:
                self._finish(s.req, "error", f"{type(exc).__name__}: {exc}")
                self.stats["failed"] += 1
            return [request_output(s.req, ()) for s in plan]
        self.num_steps += 1
        self.stats["depth_rows"] += len(host.depth_rows)
        outputs = []
        for s, mine in zip(plan, host.rows_of, strict=True):
            s.req.last_fence = fence
            leaves = s.may_exit and sampled.exit_steps[mine[0]] == s.loop
            if s.loop is not None and not (s.finishing or leaves):
                self._carry(s.req)  # its token goes on to the next loop
                continue  # (one that leaves: the step filled the planes it skips)
            rows = self._apply(s, mine, sampled, fence, host)
            if rows:
                outputs.append(self.output.emit(s.req, rows, sampled))
            elif s.req.finished:  # max_tokens 0: its prompt scored, nothing generated
                outputs.append(request_output(s.req, ()))
            if s.entry is None and not s.req.in_prefill and s.req.request_id in self.followers:
                outputs += self._fork(s.req, rows[-1] if rows else mine[-1], sampled, fence)
        if self.speculator is not None:
            self.stats.update(self.speculator.stats)
        return outputs

    def _never_fits(self, req: Request) -> RequestUpdate:
        """End a waiting request that cannot start with nothing else running: validation
        admitted it, but the pool has shrunk since (another engine on it reserved pages)."""
        need = self.allocator.blocks_for(req.num_tokens)
        self._finish(req, "error", f"needs {need} KV block(s) to start, but the pool has "
                     f"{self.allocator.num_free} free with nothing running")  # fmt: skip
        self.stats["failed"] += 1
        return request_output(req, ())

    def _run(self, host: HostStep) -> Replayed:
        """The step replayed from its graph, or run eagerly through the same forward."""
        if self.graphs is not None:
            replayed = self.graphs.run(host)
            if replayed is not None:
                return replayed
        out = self.model.forward(host.inputs(self.device.torch_device, self.device.pin_memory))
        return Replayed(out=out, picks=None, packed=None)

    @staticmethod
    def _carry(req: Request) -> None:
        """A depth row's loop ran (not its last): its token goes on to the next loop (its state
        and gate are in the store, where the step wrote them)."""
        assert req.depth is not None
        req.depth.loop += 1

    def _apply(self, s, mine: list[int], sampled: Sampled, fence, host: HostStep) -> list[int]:
        """What one request's rows computed; the sampled rows whose tokens it emits."""
        req = s.req
        req.depth = None  # a depth row at its last loop finishes its token like any other
        if s.entry is None:
            req.num_computed += s.n
            self.scheduler.register_prompt_blocks(req)
            if req.params.prompt_logprobs is not None:
                self.output.score_prompt(req, mine, sampled, host)
            if req.num_computed < req.num_tokens or not mine:
                return []
            if req.params.max_tokens == 0:  # only the prompt's log-probabilities were asked
                self._finish(req, "length")
                self.stats["finished"] += 1
                return []
            return mine[-1:]
        assert self.speculator is not None
        applied = self.speculator.apply(req, s.entry, mine, sampled)
        req.num_computed += len(applied.accepted)
        if applied.keep is not None:
            self.scheduler.trim(req, applied.keep, fence)
        return mine[: len(applied.accepted)]

    def _fork(self, leader: Request, row: int, sampled: Sampled, fence) -> list[RequestUpdate]:
        """``leader``'s prompt is computed: each request following it shares its pages and
        takes its first token from the same logits row (with its own seed and history)."""
        outputs = []
        assert sampled.logits is not None
        position = len(leader.prompt_ids)
        for req in self.followers.pop(leader.request_id, []):
            req.follows = None
            if not self.scheduler.fork(req, leader, self.model.kv.copy):
                self.scheduler.waiting.append(req)  # no page now: computed as any request
                continue
            req.last_fence = fence
            self.stats["forked"] += 1
            token = self.sampler.choose(sampled.logits[row], req, (), position)
            if req.params.prompt_logprobs is not None:
                req.prompt_logprobs = list(leader.prompt_logprobs)
            alone = attrs.evolve(sampled, tokens=[token] * len(sampled.tokens))
            outputs.append(self.output.emit(req, [row], alone))
        return outputs
