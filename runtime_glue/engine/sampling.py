"""Sampling parameters and the token choice: greedy (exact) or seeded random sampling."""

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
        if self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise ValueError(f"exit_threshold must be in (0, 1], got {self.exit_threshold}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose one token from ``logits [vocab]`` (float32).

    Greedy takes the first maximum, as HF's argmax does. Sampling is reproducible for a fixed
    ``generator`` seed: temperature, then top-k, then top-p, then one multinomial draw.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    # A stable descending sort breaks ties by token id, as argmax does: top_k=1 is greedy.
    scores, order = torch.sort(logits / params.temperature, descending=True, stable=True)
    if 0 < params.top_k < scores.numel():
        scores, order = scores[: params.top_k], order[: params.top_k]
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        probs = probs.masked_fill(torch.cumsum(probs, -1) - probs >= params.top_p, 0.0)
    return int(order[torch.multinomial(probs, 1, generator=generator)])
