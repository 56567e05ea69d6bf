"""Sampling parameters and the one sampling stage: a row's logits to its token.

Plain decoding, speculative draft and verify rows and replayed step graphs all hand the
engine a row of float32 logits (the exit rule's loop, read back once per step); this stage
turns it into a token, in vLLM's order:

1. the structured-output mask (``runtime_glue.engine.structured``): a masked-out token is
   never chosen;
2. ``min_tokens``: EOS and ``stop_token_ids`` masked until that many tokens were generated;
3. ``logit_bias``: added to the named tokens' logits;
4. penalties: ``repetition_penalty`` over the prompt's and the output's tokens (a positive
   logit divided by it, a negative one multiplied), then ``frequency_penalty`` times each
   token's count in the output and ``presence_penalty`` once for each token it holds,
   subtracted;
5. temperature, ``min_p``, top-k, top-p and the choice: greedy takes the first maximum (as
   HF's argmax does); sampling the first maximum of the kept scores plus Gumbel noise drawn
   from a generator keyed by ``(seed, position)``.

A row's *history* (the tokens generated before its position, a speculative round's drafts
included) is all the state the stage reads, so a token is a function of (logits, parameters,
history, seed, position). Nothing else decides it: not the order of draws, not a preemption
that recomputes, and not speculative decoding, whose drafts are accepted exactly when they
equal what the full depth chooses at the same position with the same history
(``runtime_glue.engine.speculative``). Each position's noise is independent of every other
position's, so a sampled token is an exact draw from its processed distribution.

Log-probabilities (``logprobs``, ``prompt_logprobs``) are those of the distribution a token
was chosen from before the stage, as vLLM's default ``raw_logprobs``: the log-softmax of the
exit loop's logits (the full depth's under speculation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from runtime_glue.engine.structured import StructuredSpec

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM's default max_logprobs


def _ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in value)


def _bias(value) -> dict[int, float]:
    return {int(k): float(v) for k, v in (value or {}).items()}


@attrs.frozen
class SamplingParams:
    max_tokens: int = 16  # 0 only with prompt_logprobs: a prompt scored, nothing generated
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(
        default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s or ())
    )
    ignore_eos: bool = False
    # Ouro's exit gate (runtime_glue.ouro.exits): which loop a token's logits come from. Unset, the
    # server's or the checkpoint's defaults apply; set, the request's own choice wins.
    exit_at_step: int | None = None
    exit_threshold: float | None = None
    weighted_exit: bool = False
    # Speculative decoding (runtime_glue.engine.speculative): tokens drafted per verify step
    # for this request; None: the engine's --num-speculative-tokens, 0: no drafts.
    num_speculative_tokens: int | None = None
    # Prefix caching: a request shares cached blocks only with requests of the same salt (as
    # vLLM's cache_salt; e.g. one per tenant).
    cache_salt: str | None = None
    # The sampling stage (the module docstring), with OpenAI's and vLLM's names and ranges.
    n: int = 1  # outputs per prompt (LLM.generate; the server's n), one seed each
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = attrs.field(factory=dict, converter=_bias)
    min_tokens: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    logprobs: int | None = None  # top tokens with each generated token's log-probability
    prompt_logprobs: int | None = None  # the same for every prompt token (the first: None)
    # Structured outputs (runtime_glue.engine.structured): vLLM's dict, exactly one of
    # {"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}; or a parsed
    # StructuredSpec (the server's, from response_format, keeps its ``strict``).
    structured_outputs: Mapping[str, Any] | StructuredSpec | None = None
    # vLLM's: with a reasoning parser, after this many reasoning tokens the end tag is forced
    # (runtime_glue.engine.reasoning); None: unbounded.
    thinking_token_budget: int | None = None
    # vLLM's detokenizing controls: special tokens left out of the text (the default), and a
    # stop string kept at the end of the text that it ended. spaces_between_special_tokens is
    # accepted for vLLM's sake: fast tokenizers (the only kind loaded) decode without it.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.exit_at_step is not None and self.exit_at_step < 0:
            raise ValueError(f"exit_at_step must be >= 0, got {self.exit_at_step}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise ValueError(f"exit_threshold must be in (0, 1], got {self.exit_threshold}")
        self._check_stage()

    def _check_stage(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(
                f"max_tokens must be > 0, got {self.max_tokens} (0 only with prompt_logprobs)"
            )
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError(
                f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether steps 2-4 change a row's logits before the choice (the engine then reads
        the logits back; a plain greedy step reads back the argmax only)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.min_p
        )

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """The token ids that end this request: EOS (unless ignored) and ``stop_token_ids``."""
        eos = frozenset() if self.ignore_eos else frozenset(eos_token_ids)
        return eos | frozenset(self.stop_token_ids)


_MASK = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for ``(seed, position)`` (splitmix64 of both: neighbouring
    positions and seeds get unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & _MASK
    return z ^ (z >> 31)


def gumbel_noise(size: int, seed: int, position: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[size]`` (float32) of one token position of one request."""
    gen = torch.Generator().manual_seed(position_seed(seed, position))
    u = torch.rand(size, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    return (-torch.log(-torch.log(u))).float()


def process(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    history: Sequence[int],
    eos_token_ids=(),
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 1-4 of the module docstring on ``logits [V]`` (float32), into a new tensor.
    ``history``: the tokens generated before this row; ``allowed``: the structured-output mask
    (bool ``[V]``), if any."""
    out = logits.clone()
    if allowed is not None:
        out.masked_fill_(~allowed, float("-inf"))
    if params.min_tokens and len(history) < params.min_tokens:
        stops = sorted(frozenset(eos_token_ids) | frozenset(params.stop_token_ids))
        if stops:
            out[torch.tensor(stops, dtype=torch.int64)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=out.dtype)
        out.index_add_(0, ids, bias)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(history)), dtype=torch.int64)
        if seen.numel():
            picked, rp = out[seen], params.repetition_penalty
            out[seen] = torch.where(picked > 0, picked / rp, picked * rp)
    if history and (params.frequency_penalty or params.presence_penalty):
        counts = Counter(history)
        ids = torch.tensor(list(counts), dtype=torch.int64)
        n = torch.tensor(list(counts.values()), dtype=out.dtype)
        out.index_add_(0, ids, -(params.frequency_penalty * n + params.presence_penalty))
    return out


def sample(logits: torch.Tensor, params: SamplingParams, seed: int = 0, position: int = 0) -> int:
    """Step 5 on ``logits [vocab]`` (float32, processed): the token at ``position``.

    Greedy takes the first maximum, as HF's argmax does. Sampling applies temperature, then
    min_p, top-k and top-p, and takes the first maximum of the kept scores plus the Gumbel
    noise of ``(seed, position)``: a draw from the kept tokens' softmax, and the same token
    whenever the logits, seed and position are the same.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    # A stable descending sort breaks ties by token id, as argmax does: top_k=1 is greedy.
    scores, order = torch.sort(logits / params.temperature, descending=True, stable=True)
    keep = max(1, int(torch.isfinite(scores).sum()))  # a masked token is never drawn
    if params.min_p:
        probs = torch.softmax(scores[:keep], dim=-1)
        keep = max(1, int((probs >= params.min_p * probs[0]).sum()))
    if 0 < params.top_k < keep:
        keep = params.top_k
    if params.top_p < 1.0:
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        probs = torch.softmax(scores[:keep], dim=-1)
        keep = max(1, int((torch.cumsum(probs, -1) - probs < params.top_p).sum()))
    noise = gumbel_noise(logits.numel(), seed, position)[order[:keep]]
    return int(order[int(torch.argmax(scores[:keep] + noise))])


@attrs.frozen
class Logprob:
    """A token's log-probability, its rank (1: the most likely) and its text, as vLLM's."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def logprobs_of(logits: torch.Tensor, token: int, top: int, decode=None) -> dict[int, Logprob]:
    """``token``'s log-probability and the ``top`` most likely tokens' under ``logits [V]``
    (float32, log-softmax in float32), each with its rank; ``decode(id)`` names them. The
    chosen token is always included, first."""
    lp = torch.log_softmax(logits, dim=-1)
    wanted = float(lp[token])
    rank = int((lp > wanted).sum()) + 1
    out = {token: Logprob(wanted, rank, decode(token) if decode else None)}
    if top:
        values, ids = torch.topk(lp, top)
        for r, (v, i) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
            out.setdefault(i, Logprob(v, r, decode(i) if decode else None))
    return out
