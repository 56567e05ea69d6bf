"""Reasoning parsers (``--reasoning-parser NAME``, vLLM's flag): a Thinking model's output,
``<think> reasoning </think> answer``, split into the chat message's ``reasoning`` and
``content``, whole or as stream deltas.

- ``deepseek_r1``: the opening tag is optional (a template may have opened the block in the
  prompt, as a Thinking template's ``enable_thinking`` does); everything before the closing
  tag is reasoning, and an output without it is reasoning still (cut off while thinking).
- ``qwen3``: reasoning only inside an opened block; an output that does not open one is all
  answer.

The tags are text: the Thinking checkpoints' tokenizers keep them in the decoded output
(``rlt-hal toy-checkpoint --thinking`` writes them as added, not special, tokens).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ReasoningParser:
    name: str
    start_optional: bool
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's ``(reasoning, content)``; None where there is none (vLLM's)."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif self.start_optional:
            body = text
        else:
            return None, text or None
        if self.end not in body:
            return body or None, None
        reasoning, content = body.split(self.end, 1)
        return reasoning or None, content or None

    def visible(self, text: str, finished: bool) -> str:
        """What of a growing output can be split now: a tail that may become a tag held back
        (``<th`` may be ``<think>``; ``</thi`` may end the block)."""
        if finished:
            return text
        stripped = text.lstrip()
        if self.start.startswith(stripped) and stripped != self.start:
            return ""  # the opening tag, or the first words, not known yet
        if self.end in text:
            return text
        for k in range(len(self.end) - 1, 0, -1):
            if text.endswith(self.end[:k]):
                return text[:-k]
        return text


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", start_optional=True),
    "qwen3": ReasoningParser("qwen3", start_optional=False),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]


class ReasoningStream:
    """One streamed choice's reasoning and content sent so far."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning, self.content = "", ""

    def advance(self, text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and content ``text`` (the whole output so far) adds."""
        reasoning, content = self.parser.split(self.parser.visible(text, finished))
        reasoning, content = reasoning or "", content or ""
        if not (reasoning.startswith(self.reasoning) and content.startswith(self.content)):
            return "", ""  # never taken back: wait for the text to settle
        r, c = reasoning[len(self.reasoning) :], content[len(self.content) :]
        self.reasoning, self.content = reasoning, content
        return r, c
