"""The engine's side of the sampling stage (``runtime_glue.engine.sampling``): one read-back
per step, then every sampled row's token, the same way for plain, draft and verify rows,
eager steps and replayed graphs.

A plain greedy step with nothing to process reads back the argmax picks only. Otherwise the
float32 logits come back once and each row is processed with its own history: the tokens its
request generated before it, and for a speculative row the drafts before its position, so a
verify row chooses exactly what plain decoding would with the drafts accepted. Its
log-probabilities, when asked, are those of its exit loop's logits before the stage
(``raw_logprobs``); a structured-output request's allowed tokens come from its matcher as it
stands after the same history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from runtime_glue.engine.graphs import Replayed, packed_of, picks_of
from runtime_glue.engine.request import Request
from runtime_glue.engine.sampling import Logprob, logprobs_of, process, sample
from runtime_glue.engine.step import HostStep


@attrs.frozen(eq=False)
class Sampled:
    """A step's choices on the host: a token and exit loop per sampled row, the logits when
    someone needs them, and each sampled row's states (and gates) on the device."""

    tokens: list[int]
    exit_steps: list[int]
    logits: torch.Tensor | None  # [R, V] float32 on the host, as read back (raw)
    states: torch.Tensor  # [T, R, H]
    gates: torch.Tensor | None


def needs_logits(req: Request) -> bool:
    """Whether a request's rows need the logits on the host (not only the argmax)."""
    p = req.params
    return bool(
        req.return_logits
        or not p.greedy
        or p.processes
        or p.logprobs is not None
        or p.prompt_logprobs is not None
        or req.matcher is not None
    )


class Sampler:
    def __init__(self, device, eos_token_ids: frozenset[int], tokenizer=None) -> None:
        self.device, self.eos, self.tokenizer = device, eos_token_ids, tokenizer

    def sample(self, result: Replayed, host: HostStep, force_logits: bool = False) -> Sampled:
        """The step's tokens and exit loops, with its one device-to-host transfer."""
        out, reqs = result.out, host.sampled
        states, gates = out.states, out.gates
        if not reqs:  # depth rows only, none at its last loop: nothing to read back
            return Sampled([], [], None, states, gates)
        if host.groups["draft"] and host.early is not None:  # what draft rows keep, before a
            states = states[: host.early].clone()  # replay overwrites it
            gates = None if gates is None else gates[: host.early].clone()
        if not force_logits and not any(needs_logits(r) for r in reqs):
            picks = result.picks if result.picks is not None else picks_of(out)
            both = self.device.to_host(picks).tolist()
            return Sampled(both[0], both[1], None, states, gates)
        packed = result.packed if result.packed is not None else packed_of(out)
        packed = self.device.to_host(packed)
        logits, steps = packed[:, :-1], [int(s) for s in packed[:, -1].tolist()]
        positions = host.token_positions
        tokens = [
            self.choose(logits[i], r, host.drafted[i], positions[i]) for i, r in enumerate(reqs)
        ]
        return Sampled(tokens, steps, logits, states, gates)

    def choose(self, logits: torch.Tensor, req: Request, drafted: Sequence[int], position: int):
        """``req``'s token at ``position`` from one row of raw logits: the stage with the
        history of the tokens before it (its output, then ``drafted``)."""
        p = req.params
        allowed = None
        if req.matcher is not None:
            allowed = req.matcher.allowed_after(drafted)
        if p.processes or allowed is not None:
            history = [*req.output_ids, *drafted]
            logits = process(logits, p, req.prompt_ids, history, self._eos(req), allowed)
        return sample(logits, p, req.seed, position)

    def _eos(self, req: Request) -> frozenset[int]:
        return frozenset() if req.params.ignore_eos else self.eos

    def logprobs(self, logits: torch.Tensor, token: int, top: int) -> dict[int, Logprob]:
        return logprobs_of(logits, token, top, self._decode)

    @property
    def _decode(self) -> Callable[[int], str] | None:
        tok = self.tokenizer
        return None if tok is None else (lambda i: tok.decode([i]))
