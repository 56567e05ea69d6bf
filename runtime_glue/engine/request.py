"""A request's state inside the engine, and what the engine reports about it each step."""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch

from hal.interfaces import Fence
from runtime_glue.engine.detokenizer import IncrementalDetokenizer
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.exits import ExitMode


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class SpecRound:
    """One request's speculative round in progress (``runtime_glue.engine.speculative``): k
    drafts, then a verify step."""

    k: int
    drafts: list[int] = attrs.field(factory=list)
    states: list[torch.Tensor] = attrs.field(factory=list)  # [E, H] of positions c, c+1, ...
    gates: list[torch.Tensor | None] = attrs.field(factory=list)  # [E] each, when gated


@attrs.define(eq=False)
class DepthToken:
    """A token part-way through its loops under depth-wise batching (``--depth-batching``):
    the loop its next step runs, and its slot in the engine's ``DepthStore``, where the state
    (and gate) after each loop already run lie, on the device."""

    slot: int
    loop: int = 0


@attrs.define(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logits: bool = False
    status: Status = Status.WAITING
    output_ids: list[int] = attrs.field(factory=list)
    blocks: list[int] = attrs.field(factory=list)  # block table: position p in blocks[p // bs]
    # Under --kv-sharing last, blocks hold the prompt only and generated position p lives in
    # generated block gen_blocks[(p - len(prompt_ids)) // bs] (runtime_glue.engine.shared_blocks).
    gen_blocks: list[int] = attrs.field(factory=list)
    block_hashes: list[bytes] = attrs.field(factory=list)  # of the prompt's full blocks
    registered: int = 0  # prompt tokens whose blocks were offered to the prefix cache
    num_computed: int = 0  # tokens whose K/V is already in every plane
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    logits: list[torch.Tensor] = attrs.field(factory=list)
    seed: int = 0  # sampled tokens are a function of (logits, seed, position)
    detokenizer: IncrementalDetokenizer | None = None
    exit_mode: ExitMode = attrs.field(factory=ExitMode)
    exit_steps: list[int] = attrs.field(factory=list)  # the loop each output token came from
    spec: SpecRound | None = None  # a speculative round in progress (engine.speculative)
    depth: DepthToken | None = None  # its next token part-way through its loops
    logprobs: list[dict] = attrs.field(factory=list)  # per output token: id -> Logprob
    prompt_logprobs: list[dict | None] = attrs.field(factory=list)  # per prompt position
    follows: str | None = None  # n > 1: the request whose prompt KV this one will share
    matcher: Any = None  # structured outputs: the grammar's state (engine.structured)
    last_fence: Fence | None = None  # of the last step that read this request's pages
    arrival_time: float = 0.0
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop-1`` of prompt + output."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        return (self.prompt_ids + self.output_ids)[start:stop]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@attrs.frozen
class RequestUpdate:
    """One request's news after a step: tokens added this step, and the state so far."""

    request_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    exit_steps: tuple[int, ...] = ()
    logprobs: tuple[dict, ...] | None = None  # per output token so far: id -> Logprob
    prompt_logprobs: tuple[dict | None, ...] | None = None  # per prompt position (first: None)
