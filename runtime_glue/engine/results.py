"""What ``LLM.generate`` and ``LLM.chat`` return, in vLLM's shape (one ``RequestOutput`` per
prompt, its ``n`` samples as ``CompletionOutput``), and the prompt forms ``generate`` takes."""

from __future__ import annotations

from typing import cast

import attrs
import torch

from runtime_glue.engine.core import InvalidRequest


@attrs.frozen
class CompletionOutput:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    logits: torch.Tensor | None = None  # float32 [generated, vocab], the chosen loop's logits
    exit_steps: tuple[int, ...] = ()  # the loop each generated token's logits came from
    # SamplingParams(logprobs=N): per generated token, token id -> Logprob (vLLM's shape);
    # prompt_logprobs=N: per prompt position, the first None.
    logprobs: tuple[dict, ...] | None = None
    prompt_logprobs: tuple[dict | None, ...] | None = None
    index: int = 0  # which of the prompt's n samples
    # LLM.chat's answer, with a reasoning parser apart from the reasoning (a server's
    # message.content and message.reasoning); generate leaves both None.
    reasoning: str | None = None
    content: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs (vLLM's; None without ``logprobs``)."""
        if self.logprobs is None:
            return None
        pairs = zip(self.logprobs, self.token_ids, strict=True)
        return float(sum(lp[t].logprob for lp, t in pairs))


@attrs.frozen
class RequestMetrics:
    """When a prompt arrived and got its first token, and when the ``generate`` call's batch
    finished (``time.monotonic()``)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float


def _one(name: str):
    def get(self: RequestOutput):
        if len(self.outputs) != 1:
            raise AttributeError(
                f"RequestOutput.{name}: this prompt has {len(self.outputs)} outputs (n > 1): "
                f"read outputs[i].{name}"
            )
        return getattr(self.outputs[0], name)

    return property(get, doc=f"``outputs[0].{name}`` where the prompt has one output.")


@attrs.frozen
class RequestOutput:
    """One prompt's result, in vLLM's shape: ``outputs`` holds its ``n`` samples
    (``CompletionOutput``, by ``index``). Where there is one, its ``text``, ``token_ids``,
    ``finish_reason``, ``logits``, ``exit_steps`` and ``logprobs`` read through (what
    ``LLM.generate`` returned before it returned this: README, "Offline inference")."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: tuple[dict | None, ...] | None = None
    metrics: RequestMetrics | None = None

    text = _one("text")
    token_ids = _one("token_ids")
    finish_reason = _one("finish_reason")
    logits = _one("logits")
    exit_steps = _one("exit_steps")
    logprobs = _one("logprobs")


def request_output(
    requests: dict, text: str | None, ids: list[int], params, return_logits: bool, finished: float
) -> RequestOutput:
    """One prompt's ``RequestOutput`` from its finished engine requests (request id -> request,
    the first one's id the prompt's), ``params`` the prompt's ``SamplingParams``; a failed
    request raises."""
    for rid, req in requests.items():
        if req.finish_reason == "error":
            raise RuntimeError(f"request {rid} failed: {req.error}")
    reqs = list(requests.values())
    outputs = [
        CompletionOutput(
            tuple(ids),
            tuple(req.output_ids),
            req.text,
            req.finish_reason,
            torch.stack(req.logits) if return_logits and req.logits else None,
            tuple(req.exit_steps),
            None if params.logprobs is None else tuple(req.logprobs),
            None if params.prompt_logprobs is None else tuple(req.prompt_logprobs),
            j,
        )
        for j, req in enumerate(reqs)
    ]
    first = [r.first_token_time for r in reqs if r.first_token_time is not None]
    return RequestOutput(
        next(iter(requests)),
        text,
        tuple(ids),
        outputs,
        prompt_logprobs=outputs[0].prompt_logprobs,
        metrics=RequestMetrics(reqs[0].arrival_time, min(first, default=None), finished),
    )


PromptsLike = str | list[int] | dict | list[str] | list[list[int]] | list[dict]


def prompt_list(prompts: PromptsLike) -> list[str | list[int] | dict]:
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [cast("str | list[int] | dict", prompts)]
    return list(cast("list[str | list[int] | dict]", prompts))


def prompt_text(prompt: str | list[int] | dict) -> str | None:
    """A prompt's text as ``RequestOutput.prompt`` reports it (None for token ids)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def prompt_of(prompt: str | list[int] | dict) -> str | list[int]:
    """A prompt's text or token ids, from any form ``generate`` takes."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise InvalidRequest(
        f"a prompt dict holds 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}", "prompt"
    )
