"""What a step's sampled rows become for their request: each token appended with its exit
loop (and its logits and log-probabilities when asked), the request's stop conditions checked,
its prompt's log-probabilities scored, and the ``RequestUpdate`` a caller sees.

The engine hands each request the rows it emits (``Engine._apply`` decides which: a prompt's
last row, a verify step's accepted rows); ``finish`` is the engine's, which takes a finished
request out of the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime_glue.engine.request import Request, RequestUpdate
from runtime_glue.engine.sampler import Sampled, Sampler
from runtime_glue.engine.step import HostStep


def request_output(req: Request, new: tuple[int, ...]) -> RequestUpdate:
    """``req`` as a caller sees it now; ``new``: the tokens this step gave it."""
    return RequestUpdate(
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
        tuple(req.logprobs) if req.params.logprobs is not None else None,
        tuple(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
    )


class Outputs:
    """A step's sampled rows applied to their requests. ``stats``: the engine's counters;
    the EOS ids are the sampler's (one set stops requests and is banned before min_tokens)."""

    def __init__(
        self,
        sampler: Sampler,
        stats: dict[str, int],
        finish: Callable[..., None],  # (request, reason, error=None): the engine's _finish
    ) -> None:
        self.sampler, self.stats, self.finish = sampler, stats, finish

    def emit(self, req: Request, rows: list[int], sampled: Sampled) -> RequestUpdate:
        """Append the tokens of ``rows`` to ``req``'s output until it finishes."""
        new = []
        for j in rows:
            token = sampled.tokens[j]
            if req.return_logits:
                assert sampled.logits is not None
                req.logits.append(sampled.logits[j].clone())
            if req.params.logprobs is not None:
                assert sampled.logits is not None
                req.logprobs.append(
                    self.sampler.logprobs(sampled.logits[j], token, req.params.logprobs)
                )
            if req.matcher is not None:
                if not req.matcher.accept(token):  # its mask allowed what it now refuses
                    self.finish(req, "error", f"the grammar engine refused token {token}, "
                                "which its own mask allowed; the output was ended there")  # fmt: skip
                    self.stats["failed"] += 1
                    break
                req.matcher = req.matcher.settled()  # (emitted tokens are never taken back)
            req.output_ids.append(token)
            req.exit_steps.append(sampled.exit_steps[j])
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            self.stats["generated_tokens"] += 1
            new.append(token)
            self._check_stop(req, token)
            if req.finished:
                break
        return request_output(req, tuple(new))

    def _check_stop(self, req: Request, token: int) -> None:
        params, detok = req.params, req.detokenizer
        stop_token = token in params.stop_ids(self.sampler.eos)
        # As vLLM's detokenizer: the token that ends a request (EOS, a stop token id) adds no
        # text unless include_stop_str_in_output (it shows with skip_special_tokens off).
        ends_here = stop_token and len(req.output_ids) >= params.min_tokens
        shown = not ends_here or params.include_stop_str_in_output
        cut = detok.add(token) if detok is not None and shown else None
        stops = stop_token
        if req.matcher is not None and req.matcher.is_terminated():
            stops = True  # the grammar allows nothing more (ignore_eos or not)
        if (stops or cut is not None) and len(req.output_ids) >= params.min_tokens:
            self.finish(req, "stop")
        elif len(req.output_ids) >= params.max_tokens:
            self.finish(req, "length")
        if detok is not None:
            if req.finished:
                detok.finish()
            req.text = detok.text if cut is None else detok.text[:cut]
        if req.finished and req.finish_reason != "abort":
            self.stats["finished"] += 1

    def score_prompt(self, req: Request, mine: list[int], sampled: Sampled, host: HostStep) -> None:
        """Each prompt row's log-probabilities of the prompt token after it (prompt position
        0 has none: None), once per position, whatever chunks or recomputation ran them."""
        assert sampled.logits is not None
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)
        top = req.params.prompt_logprobs or 0
        for j in mine:
            p = host.positions[host.sample_rows[j]]  # this row predicts position p + 1
            if p + 1 < len(req.prompt_ids) and p + 1 == len(req.prompt_logprobs):
                token = req.prompt_ids[p + 1]
                req.prompt_logprobs.append(self.sampler.logprobs(sampled.logits[j], token, top))
