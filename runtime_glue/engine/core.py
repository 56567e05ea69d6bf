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

Under ``--kv-sharing last`` (``runtime_glue.engine.shared_blocks``) a request's prompt takes
prompt blocks and its generated positions take generated blocks, T to a physical block; the
same rules hold for both kinds.

With speculative decoding on, a decoding request drafts and verifies
(``runtime_glue.engine.speculative``) in the same steps as every other request.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque

import torch

from hal.graphs import StepGraphs
from hal.interfaces import Device
from hal.shared_kv import build_shared_metadata
from hal.types import AttentionMetadata
from runtime_glue.engine.detokenizer import IncrementalDetokenizer
from runtime_glue.engine.graphs import StepGraphRunner
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.request import Request, RequestOutput, Status
from runtime_glue.engine.sampling import SamplingParams, sample
from runtime_glue.engine.scheduler import EngineConfig, Scheduling
from runtime_glue.engine.shared_blocks import SharedBlocks
from runtime_glue.engine.speculative import (
    MAX_SPECULATIVE_TOKENS,
    Entry,
    SpeculativeConfig,
    Speculator,
)
from runtime_glue.ouro import loops
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.model import OuroModel, StepInputs
from runtime_glue.ouro.plan import Admission

logger = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A request that could never run; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Engine(Scheduling):
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
        shared_blocks: SharedBlocks | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """``prefix_salt``: what besides the tokens decides a block's K/V (the checkpoint, the
        execution plan); prefix-cache hashes start from it, so engines sharing one allocator
        under other plans never share a block. ``step_graphs``: capture decode-only steps
        and replay them (``runtime_glue.engine.graphs``). ``shared_blocks``: the generated
        blocks under kv sharing (made here from ``allocator`` when not given).
        ``speculative``: draft with the first loops."""
        self.model = model
        self.prefix_salt = prefix_salt
        self.device = device
        self.allocator = allocator
        self.config = config or EngineConfig()
        self.shared: SharedBlocks | None = None
        if self.config.kv_sharing == "last":
            loops = model.cfg.total_ut_steps
            self.shared = shared_blocks or SharedBlocks(allocator, loops)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        self.graphs: StepGraphRunner | None = None
        self.graph_admission: Admission | None = None  # the graphs' check on this device
        if step_graphs is not None:
            self.graphs = StepGraphRunner(
                step_graphs, model, device, allocator, self.config.max_num_seqs, self.max_model_len
            )
            self.graph_admission = self.graphs.admit()
            if not self.graph_admission.admitted:
                logger.warning("step graphs refused: %s", self.graph_admission.why)
                allocator.free_after(self.graphs.scratch, device.record_fence())
                self.graphs = None
        self.reserved_blocks: list[int] = self.graphs.scratch if self.graphs is not None else []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
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
        }
        self.speculator: Speculator | None = None
        if speculative is not None:
            speculative.check(model.cfg.total_ut_steps, model.plan.adaptive_depth)
            if speculative.tokens >= self.config.max_num_batched_tokens:
                raise ValueError(
                    f"num_speculative_tokens ({speculative.tokens}) must be below "
                    f"max_num_batched_tokens ({self.config.max_num_batched_tokens}): a verify "
                    "step computes num_speculative_tokens + 1 rows"
                )
            self.speculator = Speculator(speculative, model.cfg.total_ut_steps)
            self.stats.update(self.speculator.stats)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def pool_tokens(self) -> int:
        usable = self.allocator.num_blocks - len(self.reserved_blocks)  # less graphs' scratch
        return usable * self.allocator.block_size

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest for a request that could never run here ("never", not
        "not now"). Every entry point (engine, LLM, server) checks through this one method."""
        max_tokens = params.max_tokens
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        loops = self.model.cfg.total_ut_steps
        if params.exit_at_step is not None and not 0 <= params.exit_at_step < loops:
            raise InvalidRequest(
                f"exit_at_step must be in [0, {loops}) (the model runs {loops} loops), "
                f"got {params.exit_at_step}",
                "exit_at_step",
            )
        if params.num_speculative_tokens:
            self._validate_speculation(params.num_speculative_tokens)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise InvalidRequest(
                f"token ids {bad[:5]} are outside the vocabulary; they must be in [0, {vocab})",
                "prompt",
            )
        n = len(prompt_token_ids)
        need = n + max_tokens
        if need > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {need} "
                f"exceeds the model's maximum length of {self.max_model_len} tokens",
                "max_tokens",
            )
        if self.shared is not None:
            blocks = self.allocator.blocks_for(n)
            blocks += self.shared.physical_for(self.allocator.blocks_for(max_tokens))
            if blocks > self.allocator.num_blocks:
                raise InvalidRequest(
                    f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {blocks} blocks of "
                    f"KV cache under kv sharing, but the whole pool has "
                    f"{self.allocator.num_blocks} blocks of {self.allocator.block_size}",
                    "max_tokens",
                )
        elif need > self.pool_tokens:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} "
                f"tokens of KV cache, but the whole pool holds {self.pool_tokens} tokens "
                f"({self.pool_tokens // self.allocator.block_size} blocks of "
                f"{self.allocator.block_size})",
                "max_tokens",
            )
        if self.config.prefill_chunk_size is None and n > self.config.max_num_batched_tokens:
            raise InvalidRequest(
                f"prompt of {n} tokens exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) with full prefill; raise "
                "--max-num-batched-tokens or set --prefill-chunk-size",
                "prompt",
            )

    def _validate_speculation(self, k: int) -> None:
        if self.speculator is None:
            raise InvalidRequest(
                "num_speculative_tokens needs an engine started with --speculative-loops",
                "num_speculative_tokens",
            )
        most = min(MAX_SPECULATIVE_TOKENS, self.config.max_num_batched_tokens - 1)
        if k > most:
            raise InvalidRequest(
                f"num_speculative_tokens must be in [0, {most}] (a verify step computes k + 1 "
                f"rows, within max_num_batched_tokens), got {k}",
                "num_speculative_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        return_logits: bool = False,
    ) -> None:
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
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        if self.config.enable_prefix_caching:
            salt = self.prefix_salt + b"|" + (params.cache_salt or "").encode()
            req.block_hashes = self.allocator.block_hashes(req.prompt_ids, salt)
        req.exit_mode = ExitMode.of(params, self.model.plan.exit_defaults)
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> bool:
        """End a live request in any state and free its pages; False if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        self.stats["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def audit_pages(self) -> None:
        """Check the allocator against the running requests' block tables (tests, debugging)."""
        tables = [req.blocks for req in self.running] + [self.reserved_blocks]
        if self.shared is not None:
            self.shared.audit([req.gen_blocks for req in self.running])
            tables.append(self.shared.homes)
        self.allocator.audit(tables)

    @property
    def num_free_blocks(self) -> int:
        self.allocator.reclaim()
        return self.allocator.num_free

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        self._release(req)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        self.requests.pop(req.request_id, None)

    def _build_step(self, plan: list[tuple[Request, int]]):
        """The step's inputs, built on the host and moved to the device in one copy; the
        request of each sampled row and the position of the token it samples; the step's row
        groups when some request drafts or verifies (else None)."""
        requests: list = []
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        sampled: list[Request] = []
        token_positions: list[int] = []
        entries: list[tuple[Request, Entry | None, int]] = []
        start = prompt_rows = prompt_samples = 0
        for req, n in plan:
            entry = self._entry(req)
            entries.append((req, entry, n))
            ctx = req.num_computed if entry is None else entry.ctx
            if self.shared is None:
                requests.append((n, ctx, req.blocks))
            else:  # no speculation under sharing (EngineArgs.check_combinations)
                requests.append((n, ctx, req.blocks, len(req.prompt_ids), req.gen_blocks))
            ids += req.tokens(ctx, ctx + n) if entry is None else entry.ids
            positions += range(ctx, ctx + n)
            if req.in_prefill:
                prompt_rows += n
            for offset in self._samples(req, entry, n):
                rows.append(start + offset)
                prompt_samples += req.in_prefill
                sampled.append(req)
                token_positions.append(ctx + offset + 1)
            start += n
        bs = self.allocator.block_size
        slots = self.allocator.num_blocks * bs
        if self.shared is None:
            meta = AttentionMetadata.build(bs, requests, slots)  # checked on the host
        else:
            cfg = self.model.cfg
            meta = build_shared_metadata(
                bs, requests, slots, cfg.num_hidden_layers, cfg.total_ut_steps
            )
        host = [torch.tensor(v, dtype=torch.int64) for v in (ids, positions, rows)]
        meta, (ids_t, pos_t, rows_t) = meta.to(
            self.device.torch_device, *host, pin=self.device.pin_memory
        )
        inputs = StepInputs(
            ids_t,
            pos_t,
            meta,
            rows_t,
            prompt_rows,
            prompt_samples,
            max(positions),
            tuple(r.exit_mode for r in sampled),
            tuple(rows),
        )
        groups = None
        if self.speculator is not None:
            normal = sum(len(self._samples(r, e, n)) for r, e, n in entries if e is None)
            groups = self.speculator.loop_rows(entries, normal, self.model.lm_head)
        return inputs, sampled, token_positions, groups

    @staticmethod
    def _samples(req: Request, entry: Entry | None, n: int) -> tuple[int, ...]:
        """Which of the ``n`` rows ``req`` runs this step are sampled (offsets)."""
        if entry is not None:
            return entry.samples
        return (n - 1,) if req.num_computed + n == req.num_tokens else ()

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self._schedule()
        if not plan:
            if self.waiting and not self.running:
                self.allocator.reclaim(wait=True)
            return []
        try:
            graphed = self.graphs.run(plan) if self.graphs is not None else None
            if graphed is None:
                inputs, sampled, token_positions, groups = self._build_step(plan)
                spec_out = None if groups is None else loops.forward(self.model, inputs, groups)
                if spec_out is None:
                    logits, exits = self.model.forward(inputs)  # [R, vocab], [R] on the device
                else:
                    logits, exits = spec_out.logits, spec_out.chosen
                picks = packed = None
            else:  # a replayed graph, whose outputs hold the picks and packed logits too
                sampled, logits, exits, picks, packed = graphed
                token_positions = [r.num_tokens for r in sampled]  # each its next token's
                spec_out = None  # no speculation under graphs (llm.speculative_config)
            fence = self.device.record_fence()
            tokens, exit_steps, host_logits = self._sample(
                logits, exits, sampled, token_positions, picks, packed
            )
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("step %d failed", self.num_steps)
            self.device.synchronize()  # nothing of the step may still be using its pages
            for req, _ in plan:
                self._finish(req, "error", f"{type(exc).__name__}: {exc}")
                self.stats["failed"] += 1
            return [self._output(req, ()) for req, _ in plan]
        self.num_steps += 1
        outputs, i, drafts = [], 0, 0
        for req, n in plan:
            entry = self._entry(req)
            req.last_fence = fence
            mine = list(range(i, i + len(self._samples(req, entry, n))))
            i += len(mine)
            if entry is None:
                req.num_computed += n
                self._register_full_prompt_blocks(req)
            elif entry.kind == "draft":
                assert self.speculator is not None and spec_out is not None
                gates = None if spec_out.draft_gates is None else spec_out.draft_gates[drafts]
                state = spec_out.draft_states[drafts]
                self.speculator.drafted(req, [tokens[j] for j in mine], state, gates)
                drafts += 1
                continue
            else:
                assert self.speculator is not None
                accepted = self.speculator.verified(req, [tokens[j] for j in mine])
                mine = mine[: len(accepted)]
                req.num_computed += len(accepted)
                keep = self.allocator.blocks_for(req.num_tokens + len(accepted))
                if len(req.blocks) > keep:  # pages that held rejected drafts only
                    self.allocator.free_after(req.blocks[keep:], fence)
                    req.blocks = req.blocks[:keep]
            if mine:
                outputs.append(self._emit(req, mine, tokens, exit_steps, host_logits))
        self._sync_spec_stats()
        return outputs

    def _emit(self, req: Request, rows: list[int], tokens, exit_steps, host_logits):
        """Append the tokens of ``rows`` to ``req``'s output until it finishes."""
        new = []
        for j in rows:
            token = tokens[j]
            if req.return_logits:
                assert host_logits is not None
                req.logits.append(host_logits[j].clone())
            req.output_ids.append(token)
            req.exit_steps.append(exit_steps[j])
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            self.stats["generated_tokens"] += 1
            new.append(token)
            self._check_stop(req, token)
            if req.finished:
                break
        return self._output(req, tuple(new))

    def _sync_spec_stats(self) -> None:
        if self.speculator is not None:
            self.stats.update(self.speculator.stats)

    def _sample(
        self,
        logits: torch.Tensor,
        exits: torch.Tensor,
        sampled: list[Request],
        positions: list[int],
        picks: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """The step's tokens and exit loops, with the step's one device-to-host transfer: the
        greedy picks (argmax on the device) when that is all the step needs, else the logits
        (float32), sampled on the host by each request's seed and the token's position.
        ``picks`` and ``packed``: both already computed on the device (by a step graph)."""
        if not any(r.return_logits or not r.params.greedy for r in sampled):
            if picks is None:
                picks = torch.stack((logits.argmax(-1), exits))
            both = self.device.to_host(picks).tolist()
            return both[0], both[1], None
        if packed is None:
            packed = torch.cat((logits.float(), exits[:, None].float()), 1)
        packed = self.device.to_host(packed)
        host, steps = packed[:, :-1], [int(s) for s in packed[:, -1].tolist()]
        tokens = [sample(host[i], r.params, r.seed, positions[i]) for i, r in enumerate(sampled)]
        return tokens, steps, host

    def _check_stop(self, req: Request, token: int) -> None:
        params, detok = req.params, req.detokenizer
        cut = detok.add(token) if detok is not None else None
        if token in self.eos_token_ids and not params.ignore_eos or cut is not None:
            self._finish(req, "stop")
        elif len(req.output_ids) >= params.max_tokens:
            self._finish(req, "length")
        if detok is not None:
            if req.finished:
                detok.finish()
            req.text = detok.text if cut is None else detok.text[:cut]
        if req.finished and req.finish_reason != "abort":
            self.stats["finished"] += 1

    def _output(self, req: Request, new: tuple[int, ...]) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            new,
            tuple(req.output_ids),
            req.text,
            req.finished,
            req.finish_reason,
            req.error,
            len(req.prompt_ids),
            req.arrival_time,
            req.first_token_time,
            tuple(req.exit_steps),
        )
