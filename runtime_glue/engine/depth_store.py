"""Where depth-wise tokens keep their states between steps (``--depth-batching``,
docs/depth-batching.md): one device buffer the steps read and write in place.

A token part-way through its loops holds a slot: ``states[slot, t]`` is its state after loop
``t`` and ``gates[slot, t]`` its gate there. Every step writes its depth rows' states (and gates)
at their loop, and reads an entering row's at the loop before (``OuroModel``); a sampled row
reads its token's loops so far. The steps index the buffer by slot: an eager step and a
replayed step graph do the same ops, and nothing of a token's states travels through the host
(a graph's replay reads and writes them where they lie).

A slot is held while its request's ``depth`` is the token that took it: a token that finishes,
leaves early, or is dropped by a preemption frees it with nothing to call. The last slot is
scratch, for a captured step's padding rows.
"""

from __future__ import annotations

import torch

from runtime_glue.engine.request import DepthToken, Request


class DepthStore:
    """``slots`` tokens in flight at once (a step's most depth rows), ``T`` loops each."""

    def __init__(
        self, slots: int, loops: int, hidden: int, dtype, device, exits: bool = False
    ) -> None:
        """``exits``: tokens may leave after any loop (adaptive depth's exits)."""
        with torch.inference_mode():  # written only inside steps (inference mode)
            self.states = torch.zeros(slots + 1, loops, hidden, dtype=dtype, device=device)
            self.gates = torch.zeros(slots + 1, loops, dtype=dtype, device=device)
        self.scratch = slots  # padding rows of captured steps
        self.exits = exits
        self._holders: list[tuple[Request, DepthToken] | None] = [None] * slots

    def token(self, req: Request) -> DepthToken:
        """``req``'s token in flight, or a new one at loop 0 in a free slot."""
        if req.depth is not None:
            return req.depth
        for slot in range(len(self._holders)):
            if not self._held(slot):
                token = DepthToken(slot=slot)
                self._holders[slot] = (req, token)
                req.depth = token
                return token
        raise RuntimeError(
            f"depth-wise batching: all {len(self._holders)} state slots are held; a step holds "
            "at most max_num_seqs depth rows"
        )

    def _held(self, slot: int) -> bool:
        """Whether ``slot``'s token is still in flight (else its holder is let go)."""
        holder = self._holders[slot]
        if holder is not None and (holder[0].depth is not holder[1] or holder[0].finished):
            self._holders[slot] = holder = None
        return holder is not None

    def held(self) -> int:
        """Slots held now (tests)."""
        return sum(self._held(slot) for slot in range(len(self._holders)))
