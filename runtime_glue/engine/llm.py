"""``LLM``: load a checkpoint onto a driver and generate, the Python entry point of rlt-hal."""

from __future__ import annotations

import copy
import logging
import sys
import time
from pathlib import Path
from typing import Any, cast

import attrs

from hal.registry import Registry, default_registry
from hal.types import KVLayout, check_block_size
from runtime_glue.engine.announce import announce_llm
from runtime_glue.engine.args import EngineArgs
from runtime_glue.engine.core import Engine, EngineConfig, InvalidRequest
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.kv_placement import placement_for
from runtime_glue.engine.reasoning import reasoning_parser
from runtime_glue.engine.refusals import DEFAULT_SPECULATIVE_TOKENS, check_engine, why_not
from runtime_glue.engine.results import (  # noqa: F401 - CompletionOutput: re-exported
    CompletionOutput,
    PromptsLike,
    RequestOutput,
    prompt_list,
    prompt_of,
    prompt_text,
    request_output,
)
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.speculative import SpeculativeConfig
from runtime_glue.engine.tokenizer import load_tokenizer, render_chat
from runtime_glue.engine.weights import (
    check_static_activations,
    check_weights_fit,
    load_model_weights,
    read_stored_quantization,
    with_stored_quantization,
)
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.model import OuroModel
from runtime_glue.ouro.plan import ExecutionPlan
from runtime_glue.ouro.quantize import weight_bytes
from runtime_glue.ouro.resolve import resolve

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 512 * 1024 * 1024


def speculative_config(args: EngineArgs) -> SpeculativeConfig | None:
    """The speculative-decoding options of ``args`` (checked by ``check_engine``); None: off."""
    if args.speculative_loops is None:
        return None
    tokens = args.num_speculative_tokens
    return SpeculativeConfig(
        args.speculative_loops, DEFAULT_SPECULATIVE_TOKENS if tokens is None else tokens
    )


def pool_blocks(
    layout_bytes_per_token: int,
    block_size: int,
    num_blocks: int | None,
    kv_cache_memory: int | None,
) -> int:
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return num_blocks
    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    blocks = memory // (layout_bytes_per_token * block_size)
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory {memory} bytes holds no block of {block_size} tokens "
            f"({layout_bytes_per_token} bytes per token)"
        )
    return int(blocks)


class LLM:
    """``LLM(model, device=..., block_size=..., ...)``: the options are ``EngineArgs``'s fields,
    declared (and defaulted) there once; ``registry``, ``driver_options`` and ``progress`` say
    how to build, not what."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        registry: Registry | None = None,
        driver_options: dict | None = None,
        progress: bool = False,
        **options: Any,
    ) -> None:
        args = EngineArgs(model=None if model is None else str(model), **options)
        self._init(args, registry, driver_options, progress)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        registry: Registry | None = None,
        driver_options: dict | None = None,
        progress: bool = False,
    ) -> LLM:
        llm = cls.__new__(cls)
        llm._init(args, registry, driver_options, progress)
        return llm

    def _init(
        self,
        args: EngineArgs,
        registry: Registry | None,
        driver_options: dict | None,
        progress: bool,
    ) -> None:
        if args.dtype != "bfloat16":
            raise ValueError(f"dtype must be 'bfloat16' (the first scope), got {args.dtype!r}")
        check_block_size(args.block_size)
        model_dir = args.model_dir()
        self.config = OuroConfig.from_dir(model_dir)
        # A checkpoint quantized elsewhere (compressed-tensors) runs as if its scheme had
        # been asked for: every check and refusal of --quantization applies to it.
        stored = read_stored_quantization(model_dir, self.config)
        if stored is not None:
            args = with_stored_quantization(args, stored)
        check_static_activations(args, stored)
        self.args, self.model_dir, self.stored_quantization = args, model_dir, stored
        self.tokenizer = load_tokenizer(self.model_dir)
        self.reasoning = reasoning_parser(args.reasoning_parser)
        registry = registry or default_registry()
        self.driver = registry.create(args.device, **(driver_options or {}))
        self.driver.device.initialize()
        self._check(args.attention_backend)  # an unknown backend or a refused option fails
        # before the weights load, and so does a memory budget they would not fit in
        check_weights_fit(args, self.config)
        cfg = self.config
        weights = load_model_weights(
            args, cfg, self.model_dir, stored, self.driver.device, progress
        )
        probe = KVLayout(cfg.num_planes, 1, args.block_size, cfg.num_key_value_heads, cfg.head_dim)
        kv_memory = args.kv_cache_memory
        if args.memory_budget is not None:
            kv_memory = args.memory_budget - weight_bytes(weights)
            if kv_memory <= 0:
                raise ValueError(
                    f"memory_budget {args.memory_budget} bytes does not hold the weights "
                    f"({weight_bytes(weights)} bytes as loaded)"
                )
        blocks = pool_blocks(probe.bytes_per_token, args.block_size, args.num_blocks, kv_memory)
        self.kv_layout = attrs.evolve(probe, num_blocks=blocks)
        self.weights = weights
        self.engine_config = EngineConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.prefill_chunk_size,
            depth_batching=args.depth_batching,
        )
        self.kv_store = self.driver.create_kv_store(self.kv_layout)
        # The pool and where requests' K/V lives in it: shared by variants.
        self.allocator = BlockAllocator(blocks, args.block_size)
        self.placement = placement_for(args, self.allocator, cfg)
        self.enable_prefix_caching = args.enable_prefix_caching
        logger.info("%s", self.kv_summary)
        plan = self._resolve(registry)
        self._build(plan)
        self._next_id = 0

    def _check(self, attention: str | None) -> None:
        """The one check every engine passes (``runtime_glue.engine.refusals``), on the
        options this one runs with and the attention backend it runs (``attention``: before
        the plan, the one asked for; after it, the plan's)."""
        backend = self.driver.backend(attention)
        check_engine(self.args, self.driver, backend, self.config)

    def _resolve(self, registry: Registry | None = None) -> ExecutionPlan:
        """The execution plan ``self.args`` resolve to on this driver."""
        args = self.args
        plan = resolve(
            self.driver,
            self.config,
            self.weights,
            args.attention_backend,
            args.deterministic,
            args.linear,
            args.exit_at_step,
            args.exit_threshold,
            args.adaptive_depth,
            mode=args.mode,
            block_size=args.block_size,
            remeasure=args.remeasure_plan,
            activations=args.quantize_activations,
        )
        if args.mode == "fast" and not plan.admissions:
            from runtime_glue.ouro.admission import nothing_to_admit

            note = nothing_to_admit(self.driver, registry or default_registry())
            logger.warning("%s", note)
            plan = attrs.evolve(plan, notes=(*plan.notes, note))
        return plan

    def _build(self, plan: ExecutionPlan) -> None:
        self._check(plan.attention)
        self.resolved = plan  # as resolved, before this engine's notes and admissions
        self.plan = plan
        self.speculative = speculative_config(self.args)
        logger.info("execution plan: %s", plan.describe())
        self.model = OuroModel(self.config, self.weights, plan, self.driver, self.kv_store)
        caching = self.enable_prefix_caching
        caching = plan.deterministic if caching is None else caching
        logger.info("prefix caching %s", "on" if caching else "off")
        graphs = None
        wanted = self.args.step_graphs
        if wanted or (wanted is None and plan.mode == "fast"):  # --mode fast: on where they can
            backend = self.driver.backend(plan.attention)
            asked = attrs.evolve(self.args, step_graphs=True)
            why = why_not(asked, self.driver, backend, self.config)
            if why is None:
                graphs = self.driver.step_graphs()
            elif wanted:
                raise ValueError(why)
            else:
                note = f"step graphs off: {why}".replace("--step-graphs: ", "")
                logger.info("%s", note)
                plan = attrs.evolve(plan, notes=(*plan.notes, note))
        self.engine = Engine(
            self.model,
            self.driver.device,
            self.allocator,
            attrs.evolve(
                self.engine_config,
                enable_prefix_caching=caching,
                depth_exits=plan.adaptive_depth,
            ),
            eos_token_ids=self.config.eos_token_ids,
            tokenizer=self.tokenizer,
            prefix_salt=f"{self.model_dir.resolve()}|{plan.describe()}".encode(),
            step_graphs=graphs,
            kv=self.placement,
            speculative=self.speculative,
            grammars=self._grammar_compiler,
            max_model_len=self.args.max_model_len,
            reasoning=self.reasoning,
        )
        limit = self.args.max_model_len
        if limit is not None and self.engine.request_capacity(1) < limit:
            raise ValueError(
                f"--max-model-len {limit}: the KV pool holds "
                f"{self.engine.request_capacity(1)} tokens for one request "
                f"({self.engine.pool_blocks} blocks of {self.args.block_size}); raise "
                "--kv-cache-memory or --num-blocks, or lower --max-model-len"
            )
        if self.engine.graph_admission is not None:  # the graphs' check on this device
            plan = attrs.evolve(plan, admissions=(*plan.admissions, self.engine.graph_admission))
        self.plan = plan
        if self.speculative is not None:
            logger.info("%s", self.speculative.describe(self.config.total_ut_steps))

    def variant(
        self,
        deterministic: bool | None = None,
        linear: str | None = None,
        adaptive_depth: bool | None = None,
        mode: str | None = None,
        depth_batching: bool | None = None,
        step_graphs: bool | None = None,
    ) -> LLM:
        """The same weights and KV pool under the plan these flags resolve to (benchmarks
        compare plans this way). Run one of the two at a time: they share the KV pool and its
        allocator (prefix-cache entries are salted with the plan, so they never mix). Refused,
        as the constructor refuses, where the flags do not combine with this engine's."""
        other = copy.copy(self)
        defaults = self.plan.exit_defaults
        other.args = attrs.evolve(
            self.args,
            deterministic=deterministic,
            linear=linear,
            adaptive_depth=self.plan.adaptive_depth if adaptive_depth is None else adaptive_depth,
            mode=mode,
            attention_backend=self.args.attention_backend
            if mode is not None
            else self.plan.attention,
            exit_at_step=defaults.step,
            exit_threshold=defaults.threshold,
            remeasure_plan=False,
            depth_batching=self.args.depth_batching if depth_batching is None else depth_batching,
            step_graphs=self.args.step_graphs if step_graphs is None else step_graphs,
        )
        other.engine_config = attrs.evolve(
            self.engine_config, depth_batching=other.args.depth_batching
        )
        other._check(other.args.attention_backend)  # before the plan's kernel trials
        other._build(other._resolve())
        return other

    def with_speculation(self, loops: int | None, tokens: int | None = None) -> LLM:
        """The same weights, plan and KV pool with speculative decoding from the first
        ``loops`` loops (None: off); ``tokens`` drafts per verify (default 4). Run one of the
        two at a time, as with :meth:`variant`; refused as the constructor refuses."""
        other = copy.copy(self)
        other.args = attrs.evolve(self.args, speculative_loops=loops, num_speculative_tokens=tokens)
        other._build(self.resolved)
        return other

    def _grammar_compiler(self):
        """The structured-output compiler, with a tokenizer of its own (the engine thread
        decodes with ``self.tokenizer``; a fast tokenizer is not to be shared across threads)."""
        from runtime_glue.engine.structured import GrammarCompiler

        tokenizer = load_tokenizer(self.model_dir)
        return GrammarCompiler(tokenizer, self.config.vocab_size, self.config.eos_token_ids)

    @property
    def mode(self) -> str:
        """The contract kept: "deterministic", "hf-exact", or "fast" (neither)."""
        return self.plan.mode

    @property
    def kv_summary(self) -> str:
        """How many tokens the KV pool holds, and what one token costs."""
        lay = self.kv_layout
        total = lay.bytes_per_token * lay.num_slots
        summary = (
            f"KV pool: {lay.num_blocks} blocks x {lay.block_size} tokens = {lay.num_slots} "
            f"tokens over {lay.num_planes} planes, {lay.bytes_per_token} bytes/token, "
            f"{total / 2**20:.1f} MiB"
        )
        return summary + self.placement.describe(lay)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: PromptsLike,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        return_logits: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt through the engine together: one ``RequestOutput`` per prompt, in
        order, each with ``SamplingParams(n=N)``'s N outputs. As vLLM's: a prompt is a string,
        token ids, ``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``; ``sampling_params``
        one for all or one per prompt; ``use_tqdm`` is accepted (no progress bar is drawn)."""
        del use_tqdm
        given = prompt_list(prompts)
        texts = [prompt_text(p) for p in given]
        encoded = [self.encode(prompt_of(p)) for p in given]
        return self._run(texts, encoded, sampling_params, return_logits)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or a list of them, each
        rendered by the checkpoint's chat template (or ``chat_template``), then generated as
        ``generate`` does; ``prompt`` is the rendered text."""
        del use_tqdm
        conversations = cast(
            "list[list[dict]]",
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        kwargs = dict(chat_template_kwargs or {})
        kwargs.update(add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message)  # fmt: skip
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        texts, ids = zip(
            *(render_chat(self.tokenizer, c, **kwargs) for c in conversations), strict=True
        )
        results = self._run(list(texts), list(ids), sampling_params, False)
        return [self._answers(r) for r in results]

    def _answers(self, result: RequestOutput) -> RequestOutput:
        """A chat result's outputs with their answer (``content``) apart from their reasoning,
        as a server's message has them (no reasoning parser: all answer)."""
        parser = self.reasoning
        if parser is None:
            outputs = [attrs.evolve(o, content=o.text) for o in result.outputs]
        else:
            opened = parser.prompt_opens(self.tokenizer.decode, result.prompt_token_ids)
            split = [parser.split(o.text, opened) for o in result.outputs]
            outputs = [
                attrs.evolve(o, reasoning=r, content=c)
                for o, (r, c) in zip(result.outputs, split, strict=True)
            ]
        return attrs.evolve(result, outputs=outputs)

    def _run(
        self,
        texts: list[str | None],
        encoded: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        return_logits: bool,
    ) -> list[RequestOutput]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(encoded):
                raise ValueError(
                    f"{len(sampling_params)} sampling params for {len(encoded)} prompts: give "
                    "one for all or one per prompt"
                )
            params_of = list(sampling_params)
        else:
            params_of = [sampling_params or SamplingParams()] * len(encoded)
        for i, (ids, params) in enumerate(
            zip(encoded, params_of, strict=True)
        ):  # all checked first
            if not ids:
                raise InvalidRequest(f"prompt {i} is empty", "prompt")
            try:
                self.engine.validate(ids, params)
            except InvalidRequest as exc:
                raise InvalidRequest(f"prompt {i}: {exc}", exc.param) from None
        prompts = []
        for ids, params in zip(encoded, params_of, strict=True):
            leader, by_id = None, {}
            for child in _samples(params):
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, ids, child, return_logits, follows=leader)
                by_id[rid] = self.engine.requests[rid]  # (finished requests leave the engine)
                leader = leader or rid
            prompts.append((by_id, ids, params))
        while self.engine.has_unfinished():
            self.engine.step()
        finished = time.monotonic()
        return [
            request_output(of_prompt, text, ids, params, return_logits, finished)
            for text, (of_prompt, ids, params) in zip(texts, prompts, strict=True)
        ]


def _samples(params: SamplingParams) -> list[SamplingParams]:
    """The ``n`` requests of one prompt: sample j with seed ``seed + j`` (vLLM's rule), one
    output each; every one after the first shares the first's prompt K/V (``follows``)."""
    if params.n == 1:
        return [params]
    seed = params.seed
    return [
        attrs.evolve(params, n=1, seed=None if seed is None else seed + j) for j in range(params.n)
    ]


def build_llm(
    args: EngineArgs, progress: bool = False, announce: bool = False, **options: Any
) -> LLM:
    """The engine ``args`` describe; ``announce`` prints what a user should know on standard
    error: the random-weights banner, the plan and the KV pool. ``options``: as
    ``LLM.from_engine_args`` (a registry, driver options)."""
    if announce and args.banner():
        print(args.banner(), file=sys.stderr)
    llm = LLM.from_engine_args(args, progress=progress, **options)
    if announce:
        announce_llm(llm)
    return llm
