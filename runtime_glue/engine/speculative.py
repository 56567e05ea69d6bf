"""Exact self-speculative decoding: Ouro's first E loops draft, its last T - E loops verify.

A request whose prompt is done and whose K/V is complete up to its last token (position
``c = num_tokens - 1`` pending) runs a *round* of k = min(K, tokens left - 1) drafts:

- k + 1 **draft steps**: step j runs position ``c + j`` through loops 0 .. E-1 only (its
  token: the last verified one for j = 0, else draft j), writing those loops' K/V and keeping
  its state after loop E-1; steps j < k take loop E-1's choice as draft ``j + 1``.
- one **verify step** runs loops E .. T-1 over the k + 1 positions ``c .. c + k``, from the
  states the draft steps kept, writing those loops' K/V, and gives each position its
  full-depth token ``y_1 .. y_{k+1}`` (the request's own exit rule over all T loops). It
  accepts the longest prefix of drafts with ``draft_i == y_i``, plus the full-depth token
  after it: ``y_1 .. y_{m+1}``, 1 to k + 1 tokens.

Exactness. Positions ``c .. c + m`` were computed from verified tokens only, so their K/V in
every plane and their full-depth logits are, in deterministic mode, bit for bit those of plain
one-token decoding (a row's bits do not depend on what shares its step); the request's K/V is
complete up to ``c + m`` and the next round starts at ``c + m + 1``. The K/V of rejected
positions ``c + m + 1 ..`` is never read: attention is causal, and each later round writes a
position's K/V before any row reads it. Pages past the last verified token are released.
Seeded sampling draws a token as a function of (logits, seed, position)
(``runtime_glue.engine.sampling``), and a draft is accepted iff it equals the full-depth
sample at its position: seeded output is identical too. Without a seed the engine draws one
per request, so the output is a sample of the target (full-depth) distribution, the same
sequence plain decoding draws with that seed. In HF-exact mode a verify step is another call
shape (k + 1 rows in one call where plain decoding issues one), so the bits are those of a
batched call: logits agree within the tolerance batching already has, and tokens part only at
a near-tie (docs/determinism.md).

A preempted request drops its round; it is recomputed from its verified tokens as any other.
Only prompt blocks enter the prefix cache, as without speculation.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import torch

from runtime_glue.engine.request import Request, SpecRound
from runtime_glue.ouro.exits import ExitMode


@attrs.frozen
class SpeculativeConfig:
    """Checked where engines are made (``runtime_glue.engine.refusals``)."""

    loops: int  # E: the draft runs loops 0 .. E-1
    tokens: int  # K: drafts per round, unless a request asks for fewer (or none)

    def describe(self, total_loops: int) -> str:
        return (
            f"speculative decoding on: {self.tokens} drafts from loops 0..{self.loops - 1}, "
            f"verified by loops {self.loops}..{total_loops - 1}"
        )


@attrs.frozen(kw_only=True)
class Entry:
    """A request's speculative rows in a step: computed once per step, from the request as it
    stands, without changing it (``Speculator.entry``)."""

    kind: str  # "draft" or "verify"
    ctx: int  # the positions before its first row
    ids: tuple[int, ...]  # its rows' tokens
    k: int  # the round's drafts
    drafts: tuple[int, ...]  # the round's drafts so far (its rows' history past the output)
    mode: ExitMode | None  # a draft row's loop (the proposer's); None: the request's own rule
    states: tuple[torch.Tensor, ...] = ()  # a verify step's: what the round's draft steps kept
    gates: tuple[torch.Tensor | None, ...] = ()

    @property
    def n(self) -> int:
        return len(self.ids)

    def history(self, row: int) -> tuple[int, ...]:
        """The drafts before row ``row`` (a draft row follows all of them)."""
        return self.drafts if self.kind == "draft" else self.drafts[:row]


@attrs.frozen(kw_only=True)
class Applied:
    """What a step's rows did to a request's round: the tokens it accepts (none for a draft
    step) and, after a verify step, the positions whose K/V it keeps (the scheduler frees the
    pages past them, which held rejected drafts only)."""

    accepted: tuple[int, ...] = ()
    keep: int | None = None


class EarlyLoops:
    """The proposer: Ouro's first E loops are its own draft. A draft row exits at loop E - 1
    (the step builder reads its rule from the entry), and its choice is the next draft."""

    def __init__(self, loops: int) -> None:
        self.loops = loops
        self.mode = ExitMode(step=loops - 1)

    def kept(self, sampled: Any, row: int):
        """A draft row's state after each draft loop ``[E, H]`` and its gates ``[E]``."""
        E = self.loops
        gates = None if sampled.gates is None else sampled.gates[:E, row]
        return sampled.states[:E, row], gates


class Speculator:
    """The engine's speculative decoding: which rows a request runs (:meth:`entry`), and what
    a step's results do to its round (:meth:`apply`)."""

    def __init__(self, config: SpeculativeConfig, total_loops: int) -> None:
        self.config = config
        self.total_loops = total_loops
        self.proposer = EarlyLoops(config.loops)
        self.stats = {"spec_drafted": 0, "spec_accepted": 0, "spec_verify_steps": 0}
        # Drafts accepted by each verify step, drained by the server's metrics (bounded when
        # nothing drains them).
        self.accepted_per_verify: deque[int] = deque(maxlen=1 << 16)

    def k_of(self, req: Request) -> int:
        own = req.params.num_speculative_tokens
        return self.config.tokens if own is None else own

    def entry(self, req: Request) -> Entry | None:
        """The rows ``req`` runs next if it drafts or verifies; None for an ordinary step.
        Changes nothing: a round begins when its first draft step is applied."""
        spec, c = req.spec, req.num_computed
        token = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
        mode = self.proposer.mode
        if spec is None:
            last = len(req.prompt_ids) + len(req.output_ids) - 1
            k = min(self.k_of(req), req.params.max_tokens - len(req.output_ids) - 1)
            if req.in_prefill or c != last or k < 1:
                return None
            return Entry(kind="draft", ctx=c, ids=(token,), k=k, drafts=(), mode=mode)
        j, drafts = len(spec.states), tuple(spec.drafts)
        if j <= spec.k:  # draft step j: position c + j
            ids = (token,) if j == 0 else (drafts[j - 1],)
            return Entry(kind="draft", ctx=c + j, ids=ids, k=spec.k, drafts=drafts, mode=mode)
        return Entry(
            kind="verify",
            ctx=c,
            ids=(token, *drafts),
            k=spec.k,
            drafts=drafts,
            mode=None,
            states=tuple(spec.states),
            gates=tuple(spec.gates),
        )

    @staticmethod
    def order(req: Request, entry: Entry | None) -> int:
        """Row groups of a step: prompt rows, generated rows, draft rows, verify rows."""
        if entry is None:
            return 0 if req.in_prefill else 1
        return 2 if entry.kind == "draft" else 3

    def apply(self, req: Request, entry: Entry, rows: list[int], sampled: Any) -> Applied:
        """The step's sampled ``rows`` of ``req`` (its entry's; ``sampled``: the step's
        ``runtime_glue.engine.sampler.Sampled``): a draft step keeps its state (and proposes
        the next draft); a verify step accepts and ends the round."""
        if entry.kind == "draft":
            state, gates = self.proposer.kept(sampled, rows[0])
            self._drafted(req, entry, sampled.tokens[rows[0]], state, gates)
            return Applied()
        accepted = self.verified(req, [sampled.tokens[r] for r in rows])
        return Applied(accepted=tuple(accepted), keep=req.num_tokens + len(accepted))

    def _drafted(self, req: Request, entry: Entry, token: int, state, gates) -> None:
        if req.spec is None:  # the round's first draft step
            req.spec = SpecRound(entry.k)
        spec = req.spec
        wants = len(spec.states) < spec.k  # the round's last draft step only keeps its state
        spec.states.append(state)
        spec.gates.append(gates)
        if wants:
            spec.drafts.append(token)
            self.stats["spec_drafted"] += 1

    def verified(self, req: Request, tokens: list[int]) -> list[int]:
        """A verify step's full-depth tokens -> the tokens accepted: the longest prefix equal
        to the drafts, plus the full-depth token after it. Ends the round."""
        spec = req.spec
        assert spec is not None and len(tokens) == spec.k + 1
        m = 0
        while m < spec.k and spec.drafts[m] == tokens[m]:
            m += 1
        req.spec = None
        self.stats["spec_accepted"] += m
        self.stats["spec_verify_steps"] += 1
        self.accepted_per_verify.append(m)
        return tokens[: m + 1]
