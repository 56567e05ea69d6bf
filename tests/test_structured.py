"""Structured outputs (runtime_glue.engine.structured) against a real byte-level BPE tokenizer.

Outputs are produced the way a model under a grammar produces them: random logits, the
matcher's mask applied, a token sampled, the matcher advanced; many seeds. An output must
parse (json.loads, re.fullmatch, the choice list) every time, and a masked-out token must never
come out.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
import torch

from runtime_glue.engine.structured import (
    GrammarCompiler,
    Matcher,
    StructuredOutputError,
    StructuredSpec,
    from_response_format,
    parse_structured,
    structured_spec,
)

EOS = (0, 2)  # <|endoftext|>, <|im_end|> as Ouro's config has them
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "title": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["book", "film", "song"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "admin": {"type": "boolean"},
                "rating": {"enum": [1, 2, 3, None]},
            },
            "required": ["admin", "rating"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "owner"],
    "additionalProperties": False,
}
SAMPLE = {"id": 42, "title": 'say "hi"', "kind": "film", "tags": ["a", "bc"],
          "owner": {"name": "Ada", "admin": True, "rating": None}}  # fmt: skip
TEXT = """\
A looped language model runs the same decoder layers several times for every token.
{"name": "Ada", "id": 12, "tags": ["x", "y"], "ok": true, "score": 3.5, "owner": null}
[{"kind": "book"}, {"kind": "film"}, {"kind": "song"}] 2024-03-14 09:30 move 12, turn 7.
The quick brown fox jumps over the lazy dog; print("hello, world") returns 0.
"""


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from runtime_glue.ouro.toy import train_tokenizer

    numbers = " ".join(f"{i} {i * 37 % 997}" for i in range(600))
    tok = train_tokenizer(1536, [TEXT] * 4 + [json.dumps(SAMPLE), numbers])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )


@pytest.fixture(scope="session")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=EOS)


def generate(m: Matcher, seed: int, max_tokens: int = 400) -> list[int]:
    """Sample under the mask from random logits until EOS; every token must be accepted."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < max_tokens:
        logits = torch.randn(m.vocab_size, generator=gen) * 3
        m.apply(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert m.accept(token), f"sampled token {token} was masked out (seed {seed})"
        if token in EOS:
            assert m.is_terminated()
            return out
        out.append(token)
    raise AssertionError(f"no EOS after {max_tokens} tokens (seed {seed})")


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def tokens_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def check_sample(obj: dict) -> None:
    """The schema's main rules by hand (jsonschema checks all of them when it is installed)."""
    assert set(obj) <= set(SCHEMA["properties"]) and {"id", "kind", "owner"} <= set(obj)
    assert isinstance(obj["id"], int) and 0 <= obj["id"] <= 9999 and obj["kind"] in SCHEMA[
        "properties"]["kind"]["enum"]  # fmt: skip
    assert set(obj["owner"]) <= {"name", "admin", "rating"} and obj["owner"]["admin"] in (0, 1)
    assert all(len(t) <= 6 for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3


@pytest.mark.parametrize(
    "whitespace",
    [{"disable_any_whitespace": True}, {"whitespace_pattern": r"[ \n]{0,2}"}],
    ids=["compact", "bounded-whitespace"],
)
def test_sampled_json_always_parses_and_validates(tokenizer, compiler, whitespace):
    try:
        import jsonschema
    except ImportError:  # the hand check below still runs
        jsonschema = None
    spec = parse_structured({"json": SCHEMA, **whitespace})
    for seed in range(40):
        obj = json.loads(text_of(tokenizer, generate(compiler.matcher(spec), seed)))
        check_sample(obj)
        if jsonschema is not None:
            jsonschema.validate(obj, SCHEMA)


def test_regex_output_matches_it_exactly(tokenizer, compiler):
    # [0-9], not \d: the engine's \d is Unicode's (Rust regex), as Python's is for str
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( at [01][0-9]:[0-5][0-9])?"
    spec = parse_structured({"regex": pattern})
    for seed in range(40):
        assert re.fullmatch(pattern, text_of(tokenizer, generate(compiler.matcher(spec), seed)))


def test_choice_output_is_exactly_one_choice(tokenizer, compiler):
    choices = ["yes", "yes, but", "no", 'say "né"']  # one a prefix of another; quotes, accent
    spec = parse_structured({"choice": choices})
    seen = {text_of(tokenizer, generate(compiler.matcher(spec), seed)) for seed in range(40)}
    assert seen <= set(choices) and len(seen) > 1
    for choice in choices:  # every choice reachable through its own tokens, then only EOS
        m = compiler.matcher(spec)
        assert all(m.accept(t) for t in tokens_of(tokenizer, choice))
        if choice != "yes":
            assert m.is_terminated() and set(m.allowed().nonzero().view(-1).tolist()) == set(EOS)


@pytest.mark.parametrize(
    "grammar",
    [
        'start: cmd (", " cmd)?\ncmd: ("move" | "turn") " " /[0-9]{1,2}/',
        'root ::= cmd (", " cmd)?\ncmd ::= ("move" | "turn") " " [0-9] [0-9]?',
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_output_is_in_the_language(tokenizer, compiler, grammar):
    spec = parse_structured({"grammar": grammar})
    for seed in range(20):
        text = text_of(tokenizer, generate(compiler.matcher(spec), seed))
        assert re.fullmatch(r"(move|turn) \d\d?(, (move|turn) \d\d?)?", text), text


def test_a_masked_out_token_is_never_chosen(tokenizer, compiler):
    m = compiler.matcher(parse_structured({"json": SCHEMA, "disable_any_whitespace": True}))
    gen = torch.Generator().manual_seed(0)
    for token in tokens_of(tokenizer, json.dumps(SAMPLE, separators=(",", ":"))):
        allowed = m.allowed()
        assert 0 < allowed.sum() < m.vocab_size
        logits = torch.randn(m.vocab_size, generator=gen)
        logits[~allowed] = 1e4  # what is masked out is what the model wants most
        raw = logits.clone()
        m.apply(logits)
        assert torch.equal(logits[allowed], raw[allowed]) and logits[~allowed].eq(-torch.inf).all()
        assert allowed[logits.argmax()]
        draws = torch.multinomial(torch.softmax(logits, -1), 64, replacement=True, generator=gen)
        assert allowed[draws].all()
        bad = int((~allowed).nonzero()[-1])
        assert not m.accept(bad)  # refused, and the state is unchanged: the next token still fits
        assert m.accept(token)


def test_rollback_restores_the_exact_mask(tokenizer, compiler):
    m = compiler.matcher(parse_structured({"json": SCHEMA}))
    ids = tokens_of(tokenizer, json.dumps(SAMPLE)) + [EOS[1]]
    masks = []
    for token in ids:
        masks.append(m.allowed().clone())
        assert m.accept(token)
    assert m.is_terminated() and m.num_accepted == len(ids)
    for back in (1, 3, 8, len(ids) - 5):  # through the EOS and back into the object
        m.rollback(back)
        assert torch.equal(m.allowed(), masks[len(ids) - back])
        assert m.is_terminated() == (back == 1)  # after the closing brace only EOS fits
        assert all(m.accept(t) for t in ids[len(ids) - back :])
    m.rollback(len(ids))
    assert torch.equal(m.allowed(), masks[0])
    with pytest.raises(ValueError, match=r"rollback n must be in \[0, 0\]"):
        m.rollback(1)


def test_draft_masks_are_the_masks_after_each_draft_and_keep_the_state(tokenizer, compiler):
    m = compiler.matcher(parse_structured({"json": SCHEMA}))
    ids = tokens_of(tokenizer, json.dumps(SAMPLE))
    for t in ids[:5]:
        m.accept(t)
    drafts = ids[5:11]
    before = m.allowed().clone()
    rows, n = m.draft_masks(drafts)
    assert n == len(drafts) and rows.shape == (len(drafts) + 1, m.vocab_size)
    assert torch.equal(m.allowed(), before) and m.num_accepted == 5
    for i, token in enumerate(drafts):  # the mask at verify position i: after drafts 0..i-1
        assert torch.equal(rows[i], m.allowed())
        m.accept(token)
    assert torch.equal(rows[-1], m.allowed())
    m.rollback(len(drafts))
    bad = int((~rows[2]).nonzero()[0])
    rows, n = m.draft_masks([*drafts[:2], bad, drafts[3]])
    assert n == 2 and torch.equal(rows[3], rows[2]) and torch.equal(rows[4], rows[2])
    assert torch.equal(m.allowed(), before)


def test_eos_only_where_the_output_is_complete(tokenizer, compiler):
    m = compiler.matcher(parse_structured({"regex": r"ab+"}))
    assert not m.allowed()[list(EOS)].any() and not m.accept(EOS[0])
    assert m.accept(tokens_of(tokenizer, "a")[0]) and m.accept(tokens_of(tokenizer, "b")[0])
    allowed = m.allowed()
    assert allowed[list(EOS)].all() and allowed.sum() > 2  # complete, yet "b" may continue
    assert m.accept(EOS[0]) and m.is_terminated()
    assert set(m.allowed().nonzero().view(-1).tolist()) == set(EOS)
    assert not m.accept(tokens_of(tokenizer, "b")[0])


def test_model_vocab_larger_than_the_tokenizers_never_allows_the_extra_ids(tokenizer):
    n = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab_size=n + 40, eos_token_ids=EOS)
    m = compiler.matcher(parse_structured({"json": {"type": "string"}}))
    allowed = m.allowed()
    assert allowed.shape == (n + 40,) and not allowed[n:].any() and allowed[:n].any()
    logits = torch.zeros(n + 40)
    logits[n:] = 1e4
    m.apply(logits)
    assert int(logits.argmax()) < n and not m.accept(n + 3)
    with pytest.raises(ValueError, match=re.escape(f"logits must have shape ({n + 40},)")):
        m.apply(torch.zeros(n))


J, R, G = "structured_outputs.json", "structured_outputs.regex", "structured_outputs.grammar"
INVALID = {  # id: (structured_outputs, the field named, the message)
    "unknown-type": ({"json": {"type": "strin"}}, J, "invalid json schema: .*strin"),
    "schema-not-json": ({"json": "{oops"}, J, "is not valid JSON"),
    "schema-not-object": ({"json": [1]}, J, "must be a JSON schema object"),
    "empty-range": ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, J, "minimum"),
    "unenforceable-keyword": ({"json": {"type": "array", "uniqueItems": True}}, J, "uniqueItems"),
    "dangling-ref": ({"json": {"$ref": "#/$defs/nope"}}, J, "invalid json schema"),
    "unclosed-group": ({"regex": "(ab"}, R, "invalid regex"),
    "bad-repeat": ({"regex": "a{3,1}"}, R, "invalid regex"),
    "gbnf-syntax": ({"grammar": "root ::= ("}, G, "invalid grammar"),
    "lark-undefined-rule": ({"grammar": "start: x"}, G, "invalid grammar"),
    "empty-choice": ({"choice": []}, "structured_outputs.choice", "non-empty list of strings"),
    "non-string-choice": ({"choice": ["a", 1]}, "structured_outputs.choice", "list of strings"),
    "empty-regex": ({"regex": ""}, R, "non-empty string"),
    "no-kind": ({}, "structured_outputs", "exactly one of json, regex, choice, grammar, got none"),
    "two-kinds": ({"json": {}, "regex": "a"}, "structured_outputs", "exactly one of"),
    "unknown-field": ({"structural_tag": "x"}, "structured_outputs", "unknown field"),
}


@pytest.mark.parametrize(("spec", "param", "message"), INVALID.values(), ids=INVALID.keys())
def test_invalid_input_raises_naming_the_field(compiler, spec, param, message):
    with pytest.raises(StructuredOutputError, match=message) as info:
        compiler.compile(parse_structured(spec))
    assert info.value.param == param and isinstance(info.value, ValueError)
    assert str(info.value)[0].islower()


def test_response_format_maps_onto_the_same_spec(compiler):
    assert from_response_format({"type": "text"}) is None and from_response_format(None) is None
    assert from_response_format({"type": "json_object"}) == parse_structured({"json_object": True})
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert from_response_format(rf) == parse_structured({"json": json.dumps(SCHEMA)})
    assert structured_spec(response_format={"type": "text"}, structured_outputs={"regex": "a"})
    loose = {"type": "array", "uniqueItems": True}  # not enforceable: strict refuses it
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": loose, "strict": False}}
    compiler.compile(from_response_format(rf))
    rf["json_schema"]["strict"] = True
    with pytest.raises(StructuredOutputError, match="uniqueItems") as info:
        compiler.compile(from_response_format(rf))
    assert info.value.param == "response_format.json_schema.schema"
    for bad, param in [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
         "response_format.json_schema.strict"),
    ]:  # fmt: skip
        with pytest.raises(StructuredOutputError) as info:
            from_response_format(bad)
        assert info.value.param == param
    with pytest.raises(StructuredOutputError, match="cannot be combined"):
        structured_spec({"type": "json_object"}, {"regex": "a"})


def test_compiler_caches_by_spec_within_a_bound_across_threads(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=EOS,
                               cache_size=2)  # fmt: skip
    a, b, c = (StructuredSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredSpec("regex", "a+", param="other")) is first
    compiler.compile(b), compiler.compile(c)
    assert compiler.compile(a) is not first  # evicted: least recently used
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(20):
                m = compiler.matcher(StructuredSpec("regex", f"x{(seed + i) % 3}y+"))
                generate(m, seed * 100 + i, max_tokens=50)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_importing_the_module_does_not_import_the_engine():
    code = (
        "import sys, runtime_glue.engine.structured as s; "
        "assert 'llguidance' not in sys.modules, 'llguidance imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
