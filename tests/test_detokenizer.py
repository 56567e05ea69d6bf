"""Incremental detokenising gives the text a full decode gives, token by token, and stops where
a full decode would first show a stop string. (Its cost per token is measured by
``rlt-hal bench detokenize``, not here.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_glue.engine.detokenizer import IncrementalDetokenizer
from runtime_glue.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def full_decode_run(tokenizer, ids, stop=()):
    """What the engine did before: decode the whole output after every token and scan all of
    it. Returns (text, tokens consumed) at the first stop string, or for all of ``ids``."""
    text = ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], n
    return text, len(ids)


def incremental_run(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, tuple(stop))
    for n, token in enumerate(ids, 1):
        cut = detok.add(token)
        if cut is not None:
            return detok.text[:cut], n
    detok.finish()
    return detok.text, len(ids)


MULTIBYTE = ["é", "日本語", "🙂👍", "naïve café", "Ωμέγα", "a\u0301"]


def _ids(tokenizer, draw):
    """Token ids: random ones (lone bytes of multi-byte characters among them) and the
    encodings of multi-byte text, whose characters are split across tokens."""
    parts = draw(
        st.lists(
            st.one_of(
                st.lists(st.integers(0, 1023), min_size=1, max_size=8),
                st.sampled_from(MULTIBYTE).map(
                    lambda s: tokenizer.encode(s, add_special_tokens=False)
                ),
            ),
            min_size=1,
            max_size=8,
        )
    )
    return [t for p in parts for t in p]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_text_equals_a_full_decode_after_every_token(tokenizer, data):
    ids = _ids(tokenizer, data.draw)
    detok = IncrementalDetokenizer(tokenizer)
    for n, token in enumerate(ids, 1):
        assert detok.add(token) is None
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        # Held tokens (an incomplete character) are the only difference, and only at the end.
        assert full.startswith(detok.text)
        assert set(full[len(detok.text) :]) <= {"\ufffd"}
    detok.finish()
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


FINAL_TEXT = st.text(min_size=1, max_size=4).filter(lambda s: "\ufffd" not in s)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), stops=st.lists(FINAL_TEXT, min_size=1, max_size=3))
def test_stop_strings_end_the_text_where_a_full_decode_first_shows_one(tokenizer, data, stops):
    # Stop strings of real characters: a full decode's transient U+FFFD (a character still
    # split across tokens) is never matched, so a request never stops inside a character.
    ids = _ids(tokenizer, data.draw)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    pairs = [full[i : i + 2] for i in range(len(full) - 1) if "\ufffd" not in full[i : i + 2]]
    stops += pairs[len(pairs) // 3 : len(pairs) // 3 + 1]  # one that hits, where there is one
    assert incremental_run(tokenizer, ids, stops) == full_decode_run(tokenizer, ids, stops)


def test_a_character_split_across_tokens_appears_once_it_is_complete(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the toy tokenizer should split this emoji into byte tokens"
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids[:-1]:
        detok.add(token)
        assert detok.text == ""  # held: a full decode would show replacement characters
    detok.add(ids[-1])
    assert detok.text == "🙂"
