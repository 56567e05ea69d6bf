"""``LLM``: load a checkpoint onto a driver and generate, the Python entry point of rlt-hal."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import attrs
import torch

from hal.registry import Registry, default_registry
from hal.types import KVLayout, check_block_size
from runtime_glue.checkpoint import load_weights
from runtime_glue.config import OuroConfig
from runtime_glue.engine import Engine, EngineConfig, InvalidRequest
from runtime_glue.kv_manager import BlockAllocator
from runtime_glue.model import OuroModel
from runtime_glue.plan import ExecutionPlan
from runtime_glue.resolve import resolve
from runtime_glue.sampling import SamplingParams
from runtime_glue.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 512 * 1024 * 1024
DEFAULT_TOY_PRESET = "small"


@attrs.frozen
class CompletionOutput:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    logits: torch.Tensor | None = None  # float32 [generated, vocab], the chosen loop's logits
    exit_steps: tuple[int, ...] = ()  # the loop each generated token's logits came from


def default_model_dir() -> Path:
    """The embedded default: a random toy checkpoint written once into a cache directory."""
    from runtime_glue.toy import cached_checkpoint

    return cached_checkpoint(DEFAULT_TOY_PRESET)


def pool_blocks(
    layout_bytes_per_token: int,
    block_size: int,
    num_blocks: int | None,
    kv_cache_memory: int | None,
) -> int:
    if num_blocks is not None and kv_cache_memory is not None:
        raise ValueError("give either num_blocks or kv_cache_memory, not both")
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
    def __init__(
        self,
        model: str | Path | None = None,
        device: str | None = None,
        dtype: str = "bfloat16",
        attention_backend: str | None = None,
        block_size: int = 128,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 8192,
        prefill_chunk_size: int | None = None,
        registry: Registry | None = None,
        driver_options: dict | None = None,
        progress: bool = False,
        deterministic: bool | None = None,
        linear: str | None = None,
        exit_at_step: int | None = None,
        exit_threshold: float | None = None,
        adaptive_depth: bool = False,
        enable_prefix_caching: bool | None = None,
    ) -> None:
        """``enable_prefix_caching``: None, on where it is exact (deterministic mode)."""
        if dtype != "bfloat16":
            raise ValueError(f"dtype must be 'bfloat16' (the first scope), got {dtype!r}")
        check_block_size(block_size)
        self.model_dir = Path(model) if model is not None else default_model_dir()
        self.config = OuroConfig.from_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.driver = (registry or default_registry()).create(device, **(driver_options or {}))
        self.driver.device.initialize()
        self.driver.backend(attention_backend)  # an unknown name fails before loading weights
        weights = load_weights(self.model_dir, self.config, self.driver.device, progress=progress)
        cfg = self.config
        probe = KVLayout(cfg.num_planes, 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        blocks = pool_blocks(probe.bytes_per_token, block_size, num_blocks, kv_cache_memory)
        self.kv_layout = attrs.evolve(probe, num_blocks=blocks)
        self.weights = weights
        self.engine_config = EngineConfig(max_num_seqs, max_num_batched_tokens, prefill_chunk_size)
        self.kv_store = self.driver.create_kv_store(self.kv_layout)
        self.allocator = BlockAllocator(blocks, block_size)  # shared by variants, as the pool is
        self.enable_prefix_caching = enable_prefix_caching
        logger.info("%s", self.kv_summary)
        self._build(
            resolve(
                self.driver,
                cfg,
                weights,
                attention_backend,
                deterministic,
                linear,
                exit_at_step,
                exit_threshold,
                adaptive_depth,
            )
        )
        self._next_id = 0

    def _build(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        logger.info("execution plan: %s", plan.describe())
        self.model = OuroModel(self.config, self.weights, plan, self.driver, self.kv_store)
        caching = self.enable_prefix_caching
        caching = plan.deterministic if caching is None else caching
        logger.info("prefix caching %s", "on" if caching else "off")
        self.engine = Engine(
            self.model,
            self.driver.device,
            self.allocator,
            attrs.evolve(self.engine_config, enable_prefix_caching=caching),
            eos_token_ids=self.config.eos_token_ids,
            tokenizer=self.tokenizer,
            prefix_salt=f"{self.model_dir.resolve()}|{plan.describe()}".encode(),
        )

    def variant(
        self,
        deterministic: bool | None = None,
        linear: str | None = None,
        adaptive_depth: bool | None = None,
    ) -> LLM:
        """The same weights and KV pool under the plan these flags resolve to (benchmarks
        compare plans this way). Run one of the two at a time: they share the KV pool and its
        allocator (prefix-cache entries are salted with the plan, so they never mix)."""
        other = copy.copy(self)
        defaults = self.plan.exit_defaults
        adaptive = self.plan.adaptive_depth if adaptive_depth is None else adaptive_depth
        plan = resolve(
            self.driver,
            self.config,
            self.weights,
            self.plan.attention,
            deterministic,
            linear,
            defaults.step,
            defaults.threshold,
            adaptive,
        )
        other._build(plan)
        return other

    @property
    def mode(self) -> str:
        """The contract kept: "deterministic", "hf-exact", or "fast" (neither)."""
        return self.plan.mode

    @property
    def kv_summary(self) -> str:
        """How many tokens the KV pool holds, and what one token costs."""
        lay = self.kv_layout
        total = lay.bytes_per_token * lay.num_slots
        return (
            f"KV pool: {lay.num_blocks} blocks x {lay.block_size} tokens = {lay.num_slots} "
            f"tokens over {lay.num_planes} planes, {lay.bytes_per_token} bytes/token, "
            f"{total / 2**20:.1f} MiB"
        )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        return_logits: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt through the engine together; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        encoded = [self.encode(p) for p in prompts]
        for i, ids in enumerate(encoded):  # all checked before any is queued
            if not ids:
                raise InvalidRequest(f"prompt {i} is empty", "prompt")
            try:
                self.engine.validate(ids, params)
            except InvalidRequest as exc:
                raise InvalidRequest(f"prompt {i}: {exc}", exc.param) from None
        ids_by_request = {}
        for ids in encoded:
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, ids, params, return_logits)
            ids_by_request[rid] = ids
        reqs = {rid: self.engine.requests[rid] for rid in ids_by_request}
        while self.engine.has_unfinished():
            self.engine.step()
        outputs = []
        for rid, req in reqs.items():
            if req.finish_reason == "error":
                raise RuntimeError(f"request {rid} failed: {req.error}")
            logits = torch.stack(req.logits) if return_logits else None
            outputs.append(
                CompletionOutput(
                    tuple(ids_by_request[rid]),
                    tuple(req.output_ids),
                    req.text,
                    req.finish_reason,
                    logits,
                    tuple(req.exit_steps),
                )
            )
        return outputs
