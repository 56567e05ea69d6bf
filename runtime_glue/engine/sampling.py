"""Sampling parameters and the token choice: greedy (exact) or seeded random sampling.

A sampled token is a function of its logits, the request's seed and the token's position
(Gumbel-max: the first maximum of ``scores + g``, where ``g`` is Gumbel noise drawn from a
generator keyed by ``(seed, position)``). Nothing else decides it: not the order of draws,
not a preemption that recomputes, and not speculative decoding, whose drafts are accepted
exactly when they equal the sample the full depth gives at the same position
(``runtime_glue.engine.speculative``). Each position's noise is independent of every other
position's, so a token is an exact draw from the processed distribution (temperature, top-k,
top-p) of its logits.
"""

from __future__ import annotations

import attrs
import torch


def _positive(_, attribute, value):
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen
class SamplingParams:
    max_tokens: int = attrs.field(default=16, validator=_positive)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def sample(logits: torch.Tensor, params: SamplingParams, seed: int = 0, position: int = 0) -> int:
    """Choose the token at ``position`` from ``logits [vocab]`` (float32).

    Greedy takes the first maximum, as HF's argmax does. Sampling applies temperature, then
    top-k, then top-p, and takes the first maximum of the kept scores plus the Gumbel noise of
    ``(seed, position)``: a draw from the kept tokens' softmax, and the same token whenever
    the logits, seed and position are the same.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    # A stable descending sort breaks ties by token id, as argmax does: top_k=1 is greedy.
    scores, order = torch.sort(logits / params.temperature, descending=True, stable=True)
    keep = scores.numel()
    if 0 < params.top_k < keep:
        keep = params.top_k
    if params.top_p < 1.0:
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        probs = torch.softmax(scores[:keep], dim=-1)
        keep = max(1, int((torch.cumsum(probs, -1) - probs < params.top_p).sum()))
    noise = gumbel_noise(logits.numel(), seed, position)[order[:keep]]
    return int(order[int(torch.argmax(scores[:keep] + noise))])
