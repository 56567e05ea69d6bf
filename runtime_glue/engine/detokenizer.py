"""A request's output text, one token at a time, in time linear in the output.

tokenizers' ``DecodeStream`` (the approach of vLLM's incremental detokenizer) decodes each new
token with the few before it that byte-level merging needs, and holds back a token that ends in
the middle of a UTF-8 character until the character is complete. Stop strings are looked for
only where a new match can be: in the new text and the ``longest - 1`` characters before it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """``text`` grows by the new text of each token; it equals a full
    ``tokenizer.decode(ids, skip_special_tokens=True)`` once :meth:`finish` has run."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer  # transformers' fast tokenizer (decodes the held tail)
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []  # tokens of an incomplete character, not yet in text
        self._stop = stop
        self._window = max((len(s) for s in stop), default=1) - 1
        self.text = ""

    def add(self, token: int) -> int | None:
        """Append ``token``'s text; the index in ``text`` where a stop string starts, if one
        now appears (the earliest, when several do)."""
        chunk = self._stream.step(self._backend, token)
        if chunk is None:
            self._held.append(token)
            return None
        self._held.clear()
        start = max(0, len(self.text) - self._window)
        self.text += chunk
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def finish(self) -> None:
        """Add what a full decode shows for held tokens (replacement characters)."""
        if self._held:
            self.text += self._tokenizer.decode(self._held, skip_special_tokens=True)
            self._held.clear()
