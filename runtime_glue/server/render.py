"""One choice's engine output in its endpoint's OpenAI shape: whole, or as stream deltas.

What differs between the endpoints and the request's options lives here: completions' text
(with ``echo``, the prompt's first) and legacy logprobs; chat's message, its logprobs and its
tool calls (``runtime_glue.server.tools``: a call's output is held back in a stream and sent as
tool-call deltas when it ends); vLLM's ``prompt_logprobs`` and rlt-hal's ``exit_steps``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from runtime_glue.engine.reasoning import THINKING, UNDECIDED, ReasoningParser, ReasoningStream
from runtime_glue.engine.request import RequestUpdate
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.server import logprobs as lp
from runtime_glue.server.tools import AutoStream, ToolPlan


@attrs.frozen(eq=False)
class Choice:
    """One choice of an OpenAI request: one engine request."""

    index: int  # OpenAI's: prompt * n + sample
    prompt: int  # which of the request's prompts
    ids: list[int]
    params: SamplingParams
    follows: int | None = None  # n > 1: the choice whose prompt pages this one shares


def stable_text(text: str, finished: bool) -> str:
    """Hold back a trailing replacement char: the next token may complete the character."""
    return text if finished or not text.endswith("\ufffd") else text.rstrip("\ufffd")


class Progress:
    """What one choice of a stream has sent so far."""

    def __init__(
        self,
        tools: ToolPlan | None,
        reasoning: ReasoningParser | None = None,
        opened: bool | None = None,
    ) -> None:
        self.text, self.tokens, self.exit_steps, self.opened = "", 0, 0, False
        self.last: RequestUpdate | None = None
        self.auto = AutoStream() if tools is not None and tools.mode == "auto" else None
        self.logprobs: lp.CompletionLogprobs | None = None
        self.reasoning = ReasoningStream(reasoning, opened) if reasoning is not None else None

    def content(self) -> str:
        """The answer sent or known so far (with a reasoning parser: after the reasoning)."""
        return self.text if self.reasoning is None else self.reasoning.content

    def advance(self, out: RequestUpdate) -> str:
        """The text ``out`` adds to what was sent (held back while a character is split)."""
        self.last = out
        text = stable_text(out.text, out.finished)
        if not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


class Render:
    """The shapes of one request's choices. ``decode(id)``: a token's text (a prompt's first
    token has no log-probability row to name it); ``prompt_texts``: each prompt as text, for
    ``echo``."""

    def __init__(
        self,
        chat: bool,
        body,
        decode: Callable[[int], str],
        prompt_texts: list[str] | None = None,
        tools: ToolPlan | None = None,
        reasoning: ReasoningParser | None = None,
        opened: bool | None = None,
        end_id: int | None = None,
    ) -> None:
        self.chat, self.body, self.decode = chat, body, decode
        self.reasoning = reasoning if chat else None
        self.opened = opened  # what the prompt did to the reasoning block (prompt_opens)
        self.end_id = end_id  # the end tag's token (ThinkingTags), where it is one token
        self.prompt_texts, self.tools = prompt_texts or [], tools
        self.echo = not chat and body.echo
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    # -- whole responses ---------------------------------------------------------------------

    def choice(self, choice: Choice, out: RequestUpdate) -> dict:
        reason = out.finish_reason
        if self.chat:
            reasoning, content = self._split(out.text)
            calls: list[dict] = []
            if self.tools is not None and self.tools.parses:
                content, calls = self.tools.calls(content or "")
            message: dict = {"role": "assistant", "content": content}
            if self.reasoning is not None and self.body.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
            result = {"index": choice.index, "message": message}
            result["logprobs"] = self._chat_logprobs(out, 0)
        else:
            echoed = self.prompt_texts[choice.prompt] if self.echo else ""
            result = {"index": choice.index, "text": echoed + out.text}
            result["logprobs"] = self._completion_logprobs(choice, out, 0, Progress(None))
            if self.body.prompt_logprobs is not None:
                result["prompt_logprobs"] = lp.prompt_logprobs(out.prompt_logprobs or ())
        result["finish_reason"] = reason
        if self.body.return_exit_steps:
            result["exit_steps"] = list(out.exit_steps)
        return result

    def reasoning_tokens(self, out: RequestUpdate) -> int:
        """How many of the output's tokens are its reasoning: up to the end tag's last one (the
        tags count, so a block closed at once is one), all of an output still thinking, none of
        one that never thought."""
        parser = self.reasoning
        assert parser is not None
        begins = parser.begins(self.opened)
        opens = begins == UNDECIDED and out.text.startswith(parser.start)
        if begins != THINKING and not opens:
            return 0
        ids = out.token_ids
        if self.end_id is not None:
            return ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)
        text = ""
        for i, token in enumerate(out.token_ids):
            text += self.decode(token)
            if parser.end in text:
                return i + 1
        return len(out.token_ids)

    def _split(self, text: str) -> tuple[str | None, str | None]:
        """A chat output's reasoning and answer (no parser: all answer)."""
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, self.opened)

    def extras(self, finals: dict[int, RequestUpdate]) -> dict:
        """Response-level fields: chat's ``prompt_logprobs`` (one prompt: choice 0's)."""
        if not self.chat or self.body.prompt_logprobs is None or not finals:
            return {}
        first = finals[min(finals)]
        return {"prompt_logprobs": lp.prompt_logprobs(first.prompt_logprobs or ())}

    def _chat_logprobs(self, out: RequestUpdate, start: int) -> dict | None:
        if not self.chat or not self.body.logprobs or out.logprobs is None:
            return None
        tokens, rows = out.token_ids[start:], out.logprobs[start:]
        as_ids = bool(self.body.return_tokens_as_token_ids)
        return {"content": lp.chat_content(tokens, rows, self.body.top_logprobs or 0, as_ids)}

    def _completion_logprobs(
        self, choice: Choice, out: RequestUpdate, start: int, progress: Progress
    ) -> dict | None:
        """Legacy logprobs of the tokens from ``start`` (an echoed prompt's first, once)."""
        if self.chat or self.body.logprobs is None or out.logprobs is None:
            return None
        blocks = []
        if progress.logprobs is None:
            progress.logprobs = lp.CompletionLogprobs(
                self.decode, as_ids=bool(self.body.return_tokens_as_token_ids)
            )
            if self.echo:
                blocks.append(progress.logprobs.block(choice.ids, out.prompt_logprobs or ()))
                progress.logprobs.offset = len(self.prompt_texts[choice.prompt])
        blocks.append(progress.logprobs.block(out.token_ids[start:], out.logprobs[start:]))
        return lp.join(*blocks)

    # -- streams -----------------------------------------------------------------------------

    def opening(self, choice: Choice) -> dict | None:
        """Chat opens each choice with its role, as OpenAI's and vLLM's do."""
        if not self.chat:
            return None
        return self._delta(choice.index, {"role": "assistant", "content": ""}, None, None)

    def delta(self, choice: Choice, out: RequestUpdate, progress: Progress) -> dict | None:
        """The chunk payload of what ``out`` adds, or None when there is nothing to send yet."""
        text = progress.advance(out)
        thought = ""
        if self.chat and progress.reasoning is not None:  # the reasoning, then the answer
            thought, text = progress.reasoning.advance(progress.text, out.finished)
            if not self.body.include_reasoning:
                thought = ""
        held = self.chat and self.tools is not None and self.tools.parses
        if held:  # only an auto output's content before a tool call goes out as it comes
            auto = progress.auto
            text = auto.feed(progress.content()) if auto is not None and not out.finished else ""
        if self.echo and not progress.opened:
            text = self.prompt_texts[choice.prompt] + text
        if not text and not thought and not out.finished:
            return None
        progress.opened = True
        start, progress.tokens = progress.tokens, len(out.token_ids)
        reason = out.finish_reason if out.finished else None
        if self.chat:
            delta: dict = {"reasoning": thought} if thought else {}
            if text:
                delta["content"] = text
            if held and out.finished:
                calls, reason = self._held_calls(out, progress, reason)
                delta = {**({"reasoning": thought} if thought else {}), **calls}
            logprobs = self._chat_logprobs(out, start)
        else:
            delta = {"text": text}
            logprobs = self._completion_logprobs(choice, out, start, progress)
        payload = self._delta(choice.index, delta, logprobs, reason)
        if self.body.return_exit_steps:  # the tokens' loops since the last chunk
            payload["exit_steps"] = list(out.exit_steps[progress.exit_steps :])
            progress.exit_steps = len(out.exit_steps)
        return payload

    def _held_calls(self, out: RequestUpdate, progress: Progress, reason):
        """The end of a held-back output: the content not sent yet, and the tool calls."""
        assert self.tools is not None
        content, calls = self.tools.calls(self._split(out.text)[1] or "")
        sent = progress.auto.sent if progress.auto is not None else ""
        delta: dict = {}
        if content and content[len(sent) :]:  # content begins with what was sent
            delta["content"] = content[len(sent) :]
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            reason = "tool_calls" if reason == "stop" else reason
        return delta, reason

    def _delta(self, index: int, delta: dict, logprobs, reason) -> dict:
        if self.chat:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, **delta, "logprobs": logprobs, "finish_reason": reason}
