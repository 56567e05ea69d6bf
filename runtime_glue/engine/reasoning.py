"""Reasoning: a Thinking model's output, ``<think> reasoning </think> answer``, split into its
reasoning and its answer (``--reasoning-parser NAME``, vLLM's flag), and the engine's side of it:
a grammar that starts after the reasoning, and a thinking budget.

The parsers:

- ``deepseek_r1``: the opening tag is optional (a template may have opened the block in the
  prompt, as a Thinking template's ``enable_thinking`` does); everything before the closing
  tag is reasoning, and an output without it is reasoning still (cut off while thinking).
- ``qwen3``: reasoning only inside an opened block; an output that does not open one is all
  answer.

Either way the prompt's end decides first (``prompt_opens``): a generation prompt that ends
with the opening tag began the block (the output is reasoning until its end tag), one that
ends with the closing tag closed it (a template asked not to think: the output is all answer).

The tags are text: the Thinking checkpoints' tokenizers keep them in the decoded output
(``rlt-hal toy-checkpoint --thinking`` writes them as added, not special, tokens). The engine
follows them as tokens (``ReasoningMatcher``): each must be one token of the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from runtime_glue.engine.structured import MaskSteps

# Where an output begins: inside the reasoning block, in the answer, or (qwen3's rule with a
# prompt that says nothing) free to open a block with its first token.
THINKING, ANSWER, UNDECIDED = "thinking", "answer", "undecided"


@attrs.frozen
class ReasoningParser:
    name: str
    start_optional: bool
    start: str = "<think>"
    end: str = "</think>"

    def begins(self, opened: bool | None) -> str:
        """Where an output begins, given what its prompt did (``prompt_opens``)."""
        if opened is not None:
            return THINKING if opened else ANSWER
        return THINKING if self.start_optional else UNDECIDED

    def split(self, text: str, opened: bool | None = None) -> tuple[str | None, str | None]:
        """A whole output's ``(reasoning, content)``; None where there is none (vLLM's).
        ``opened``: what the prompt did (``prompt_opens``)."""
        begins = self.begins(opened)
        if begins == ANSWER:
            return None, text or None
        # qwen3's rule: the output's first token opens the block or not (the engine follows it
        # so); a thinking output may repeat the tag after whitespace.
        stripped = text.lstrip() if begins == THINKING else text
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif begins == THINKING:
            body = text
        else:
            return None, text or None
        if self.end not in body:
            return body or None, None
        reasoning, content = body.split(self.end, 1)
        return reasoning or None, content or None

    def visible(self, text: str, finished: bool, opened: bool | None = None) -> str:
        """What of a growing output can be split now: a tail that may become a tag held back
        (``<th`` may be ``<think>``; ``</thi`` may end the block)."""
        if finished or self.begins(opened) == ANSWER:
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

    def prompt_opens(self, decode, prompt_ids: Sequence[int], tail: int = 8) -> bool | None:
        """Whether the prompt's end (its generation prompt) opened the reasoning block (True),
        closed it (False: a template asked not to think) or neither (None). ``decode``: ids to
        text; the last ``tail`` tokens are read, trailing whitespace ignored."""
        text = decode(list(prompt_ids[-tail:])).rstrip()
        if text.endswith(self.start):
            return True
        if text.endswith(self.end):
            return False
        return None


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

    def __init__(self, parser: ReasoningParser, opened: bool | None = None) -> None:
        self.parser, self.opened = parser, opened
        self.reasoning, self.content = "", ""

    def advance(self, text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and content ``text`` (the whole output so far) adds."""
        shown = self.parser.visible(text, finished, self.opened)
        reasoning, content = self.parser.split(shown, self.opened)
        reasoning, content = reasoning or "", content or ""
        if not (reasoning.startswith(self.reasoning) and content.startswith(self.content)):
            return "", ""  # never taken back: wait for the text to settle
        r, c = reasoning[len(self.reasoning) :], content[len(self.content) :]
        self.reasoning, self.content = reasoning, content
        return r, c


# -- the engine's side: tags as tokens -------------------------------------------------------


@attrs.frozen
class ThinkingTags:
    """A parser's tags as token ids of one tokenizer."""

    parser: ReasoningParser
    start: int
    end: int

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer) -> ThinkingTags | str:
        """The tags' ids, or why the engine cannot follow them (a tag that is not one token)."""
        ids = []
        for tag in (parser.start, parser.end):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                return (
                    f"the reasoning tag {tag!r} is {len(encoded)} tokens of this tokenizer, not "
                    "one (a Thinking checkpoint's tokenizer has it as an added token)"
                )
            ids.append(encoded[0])
        return cls(parser, ids[0], ids[1])


# vLLM's reasoning_effort (OpenAI's) as a thinking budget, in tokens; "high" thinks unbounded.
EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 128,
    "low": 512,
    "medium": 2048,
    "high": None,
    "xhigh": None,
}


def effort_budget(effort: str) -> int | None:
    """``reasoning_effort``'s thinking budget (``EFFORT_BUDGETS``); ValueError if unknown."""
    if effort not in EFFORT_BUDGETS:
        raise ValueError(
            f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}"
        )
    return EFFORT_BUDGETS[effort]


class ReasoningMatcher(MaskSteps):
    """A request's grammar (``inner``, a ``structured.Matcher``) applied from the token after
    the reasoning's end, and its thinking budget: after ``budget`` reasoning tokens the end tag
    is the only token allowed. The matcher interface (``accept``, ``rollback``, ``allowed``,
    ``allowed_after``, ``is_terminated``), so every mode, speculation and replayed graphs
    included, masks through it as through a plain grammar: a draft that crosses the end tag is
    masked by the right state.

    While thinking every token is allowed but EOS where a grammar waits (the answer must come);
    with ``qwen3``'s rule and a prompt that opened nothing, the first token may also open the
    block. ``inner`` None: the budget alone."""

    def __init__(
        self,
        tags: ThinkingTags,
        begins: str,
        vocab_size: int,
        eos: Sequence[int],
        inner: Any = None,
        budget: int | None = None,
    ) -> None:
        self.tags, self.inner, self.budget = tags, inner, budget
        self.vocab_size, self.eos = vocab_size, tuple(eos)
        self.phase, self.thought = begins, 0
        self._undo: list[tuple[str, int, bool]] = []  # per accepted token: the state before
        self.num_accepted = 0

    def is_terminated(self) -> bool:
        return self.phase == ANSWER and self.inner is not None and self.inner.is_terminated()

    def _forced(self) -> bool:
        return self.phase == THINKING and self.budget is not None and self.thought >= self.budget

    def accept(self, token_id: int) -> bool:
        phase, thought, fed = self.phase, self.thought, False
        if phase == THINKING:
            opening = token_id == self.tags.start and not self.num_accepted  # not reasoning
            if self._forced() and token_id != self.tags.end and not opening:
                return False
            if token_id in self.eos and self.inner is not None:
                return False
            if token_id == self.tags.end:
                self.phase = ANSWER
            self.thought += not opening
        elif phase == UNDECIDED and token_id == self.tags.start:
            self.phase = THINKING  # the budget counts what follows the tag
        else:
            if self.inner is not None and not self.inner.accept(token_id):
                return False
            self.phase, fed = ANSWER, self.inner is not None
        self._undo.append((phase, thought, fed))
        self.num_accepted += 1
        return True

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.num_accepted:
            raise ValueError(f"rollback n must be in [0, {self.num_accepted}], got {n}")
        if n == 0:
            return
        undone = self._undo[-n:]
        del self._undo[-n:]
        fed = sum(f for _, _, f in undone)
        if fed:
            self.inner.rollback(fed)
        self.phase, self.thought = undone[0][0], undone[0][1]
        self.num_accepted -= n

    def settled(self):
        """What masks the rest of the output: the grammar alone (or nothing) once the answer
        began, so that a budget's request leaves the masked path with its reasoning."""
        return self.inner if self.phase == ANSWER else self

    def allowed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.vocab_size, dtype=torch.bool) if out is None else out
        if self.phase == THINKING:
            if self._forced():
                out.fill_(False)
                out[self.tags.end] = True
                out[self.tags.start] = not self.num_accepted  # the output may open it still
            else:
                out.fill_(True)
                if self.inner is not None:
                    out[list(self.eos)] = False
            return out
        if self.inner is not None:
            self.inner.allowed(out)
        else:
            out.fill_(True)
        if self.phase == UNDECIDED:
            out[self.tags.start] = True
        return out
