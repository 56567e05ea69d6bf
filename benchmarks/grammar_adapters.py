"""The two grammar engines behind one interface for ``grammar_engines.py`` (``Xgrammar``,
``Llguidance``: compile, matcher, fill a bitmask, accept, reset, done, matches), and the
helpers that read and apply the int32 token bitmask both engines fill.
"""

from __future__ import annotations

import json

from grammar_cases import EOS_IDS


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab, stop_token_ids=list(EOS_IDS)
        )

    def compile(self, kind: str, text: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":  # compact: no free whitespace, see grammar_cases.CASES
            return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":  # vLLM turns a choice into a grammar of quoted alternatives
            alts = " | ".join(json.dumps(c) for c in json.loads(text))
            return compiler.compile_grammar(f"root ::= {alts}")
        return compiler.compile_grammar(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def reset(self, m) -> None:
        m.reset()

    def done(self, m) -> bool:
        return m.is_terminated()

    def matches(self, compiled, tokens: list[int]) -> bool:
        m = self.matcher(compiled)
        return all(m.accept_token(t) for t in tokens) and m.is_completed()


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int):
        import llguidance
        import llguidance.hf  # not llguidance.torch: its torch.compile import costs ~3 s

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=list(EOS_IDS))

    def compile(self, kind: str, text: str):
        # as vLLM's llguidance backend (grammar_from), JSON compact: no free whitespace, see
        # grammar_cases.CASES
        grammar = (
            self.llg.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False}
            )
            if kind == "json"
            else self.llg.grammar_from(kind, text)
        )
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask) -> None:
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def reset(self, m) -> None:
        m.reset()

    def done(self, m) -> bool:
        return m.is_stopped()

    def matches(self, compiled, tokens: list[int]) -> bool:
        m = self.matcher(compiled)
        return m.consume_tokens(tokens) and m.is_accepting()


def allowed_ids(bitmask, vocab: int) -> set[int]:
    import torch

    bits = (bitmask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.view(-1)[:vocab]).view(-1).tolist())


def is_allowed(bitmask, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def apply_bitmask(bitmask, logits, vocab: int) -> None:
    """The engine-independent apply (as ``runtime_glue.engine.structured``): unpack, fill."""
    import numpy as np
    import torch

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab]
    logits.masked_fill_(torch.from_numpy(bits.view(np.bool_)).logical_not_(), float("-inf"))
