"""Log-probabilities in the OpenAI shapes, from the engine's (per token: id -> ``Logprob``).

- completions (OpenAI's legacy shape): ``tokens``, ``token_logprobs``, ``top_logprobs`` (per
  token a dict token text -> logprob: the top N and the chosen token, as vLLM's) and
  ``text_offset`` (each token's offset in the choice's text: with ``echo``, the prompt's tokens
  come first, the first of them with ``null`` logprobs);
- chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``, the
  top N by rank;
- vLLM's ``prompt_logprobs``: per prompt position ``null`` (the first) or a dict token id (as
  text) -> ``{logprob, rank, decoded_token}``.

The values are the engine's floats as they are (JSON carries a float exactly); ``-inf``, which
JSON cannot, is sent as -9999.0, as vLLM sends it. With vLLM's ``return_tokens_as_token_ids``
(``as_ids``) every token is named ``"token_id:N"`` instead of by its text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime_glue.engine.sampling import Logprob

FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, FLOOR)


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _name(token: int, lp: Logprob, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else _text(lp)


class CompletionLogprobs:
    """One choice's legacy logprobs, built up as tokens come (``offset``: where the next
    token's text begins in the choice's text)."""

    def __init__(self, decode: Callable[[int], str], offset: int = 0, as_ids: bool = False):
        self.decode, self.offset, self.as_ids = decode, offset, as_ids

    def block(self, tokens: Sequence[int], rows: Sequence[dict | None]) -> dict:
        """The shape for ``tokens`` (a prompt's or generated), each with its row (``None``: a
        prompt's first token, which has no log-probability; ``decode`` names it)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, row in zip(tokens, rows, strict=True):
            text = self.decode(token) if row is None else _text(row[token])
            out["tokens"].append(f"token_id:{token}" if self.as_ids else text)
            out["token_logprobs"].append(None if row is None else _value(row[token]))
            top = None if row is None else {
                _name(t, lp, self.as_ids): _value(lp) for t, lp in row.items()
            }  # fmt: skip
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def join(*blocks: dict) -> dict:
    """Legacy blocks one after the other (an echoed prompt's, then the output's)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for block in blocks:
        for key in out:
            out[key] += block[key]
    return out


def _entry(token: int, lp: Logprob, as_ids: bool) -> dict:
    text = _name(token, lp, as_ids)
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def chat_content(
    tokens: Sequence[int], rows: Sequence[dict], top: int, as_ids: bool = False
) -> list[dict]:
    """The chat shape's ``content`` entries of ``tokens``; ``top``: ``top_logprobs``."""
    out = []
    for token, row in zip(tokens, rows, strict=True):
        best = sorted((it for it in row.items() if it[1].rank <= top), key=lambda it: it[1].rank)
        tops = [_entry(t, lp, as_ids) for t, lp in best[:top]]
        out.append({**_entry(token, row[token], as_ids), "top_logprobs": tops})
    return out


def prompt_logprobs(rows: Sequence[dict | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field."""
    return [
        None
        if row is None
        else {
            str(token): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in row.items()
        }
        for row in rows
    ]
