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
    ``tokenizer.decode(ids, skip_special_tokens=...)`` once :meth:`finish` has run."""

    def __init__(
        self,
        tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer  # transformers' fast tokenizer (decodes the held tail)
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # tokens of an incomplete character, not yet in text
        self._stop = stop
        self._include_stop = include_stop
        self._window = max((len(s) for s in stop), default=1) - 1
        self.text = ""

    def add(self, token: int) -> int | None:
        """Append ``token``'s text; if a stop string now appears (the earliest, when several
        do), where the output text ends: where it starts, or with ``include_stop`` where it
        ends (vLLM's include_stop_str_in_output)."""
        chunk = self._stream.step(self._backend, token)
        if chunk is None:
            self._held.append(token)
            return None
        self._held.clear()
        start = max(0, len(self.text) - self._window)
        self.text += chunk
        hits = [(i, len(s)) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return at + length if self._include_stop else at

    def finish(self) -> None:
        """Add what a full decode shows for held tokens (replacement characters)."""
        if self._held:
            self.text += self._tokenizer.decode(self._held, skip_special_tokens=self._skip)
            self._held.clear()
