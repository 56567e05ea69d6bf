"""The cases the grammar-engine benchmark (``grammar_engines.py``) runs, as data, and its
tokenizer.

- ``CASES``: one grammar of each kind (a nested JSON schema, a regex, a choice list, a small
  GBNF grammar), each with a valid output whose canonical tokens are replayed;
- ``COVERAGE``: the JSON Schema features checked, each with valid and invalid instances;
- ``build_tokenizer``: the byte-level BPE of exactly ``VOCAB`` tokens both engines are given.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

VOCAB = 49152
EOS_IDS = (0, 2)  # Ouro's <|endoftext|> and <|im_end|>

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}
SCHEMA_SAMPLE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "active": True,
    "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "scores": [9.5, 8.25],
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,2}, (19|20)[0-9]{2} at ([01][0-9]|2[0-3]):[0-5][0-9]"
CHOICES = ["positive", "negative", "neutral", "mixed (see the comment)"]
# GBNF, the form both engines read: xgrammar natively, llguidance converts it to Lark.
EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""

# JSON Schema coverage: (feature, schema, valid instances, invalid instances). An instance is
# fed as the canonical tokens of its text, then the matcher must (not) be accepting.
_OBJ = {"type": "object", "additionalProperties": False}
COVERAGE = [
    (
        "nested objects, required, additionalProperties false",
        SCHEMA,
        [json.dumps(SCHEMA_SAMPLE, separators=(",", ":"))],
        [
            '{"name":"x","role":"admin","tags":[]}',
            '{"name":"x","role":"admin","tags":[],"address":{"city":"a","zip":"12345"},"x":1}',
        ],
    ),
    ("enum", {"enum": ["red", "green", 3]}, ['"red"', "3"], ['"blue"', "4"]),
    ("const", {"const": "fixed"}, ['"fixed"'], ['"other"']),
    ("string pattern", {"type": "string", "pattern": "^[0-9]{5}$"}, ['"12345"'], ['"1234a"']),
    (
        "maxLength (escapes count as one character)",
        {"type": "string", "maxLength": 5},
        ['"a\\"b"', '"a\\nb"'],
        ['"abcdef"', '"a\x01b"'],
    ),
    ("no raw control characters in strings", {"type": "string"}, ['"a\\u0001b"'], ['"a\x01b"']),
    (
        "format date-time",
        {"type": "string", "format": "date-time"},
        ['"2024-03-14T09:30:00Z"'],
        ['"yesterday"'],
    ),
    ("format email", {"type": "string", "format": "email"}, ['"ada@example.com"'], ['"ada"']),
    (
        "format uuid",
        {"type": "string", "format": "uuid"},
        ['"123e4567-e89b-12d3-a456-426614174000"'],
        ['"123"'],
    ),
    (
        "integer minimum/maximum",
        {"type": "integer", "minimum": 1, "maximum": 12},
        ["1", "12"],
        ["0", "13", "1.5"],
    ),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, ["0.5"], ["0", "-1"]),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, ["15"], ["7"]),
    (
        "array minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        ["[1]", "[1,2]"],
        ["[]", "[1,2,3]"],
    ),
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        ["[1,2]"],
        ["[1,1]"],
    ),
    (
        "anyOf, nullable (OpenAI strict style)",
        {
            **_OBJ,
            "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["a"],
        },
        ['{"a":null}', '{"a":"x"}'],
        ['{"a":1}', "{}"],
    ),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, ["1", "true"], ['"x"']),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, ["3"], ["2"]),
    (
        "$defs / $ref (pydantic nested models)",
        {
            "$defs": {"P": {**_OBJ, "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            **_OBJ,
            "properties": {"p": {"$ref": "#/$defs/P"}},
            "required": ["p"],
        },
        ['{"p":{"x":1}}'],
        ['{"p":{}}'],
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "T": {
                    **_OBJ,
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}},
                    },
                    "required": ["v", "kids"],
                }
            },
            "$ref": "#/$defs/T",
        },
        ['{"v":1,"kids":[{"v":2,"kids":[]}]}'],
        ['{"v":1,"kids":[{}]}'],
    ),
    (
        "additionalProperties schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        ['{"a":1,"b":2}'],
        ['{"a":"x"}'],
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x_": {"type": "integer"}},
            "additionalProperties": False,
        },
        ['{"x_a":1}'],
        ['{"y":1}'],
    ),
    ("minProperties", {"type": "object", "minProperties": 1}, ['{"a":1}'], ["{}"]),
    (
        "properties in another order",
        {
            **_OBJ,
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        ['{"b":1,"a":2}'],
        [],
    ),
    ("not", {"not": {"type": "integer"}}, ['"x"'], ["1"]),
    ("if / then", {"if": {"type": "integer"}, "then": {"minimum": 3}}, ["3"], ["2"]),
]

# JSON is compiled without free whitespace in both engines (vLLM's disable_any_whitespace):
# with it, random walks spend most tokens in whitespace runs, the cheapest state there is, and
# the two engines' whitespace rules differ. The coverage check uses the same setting.

CASES = {
    "json": ("json", json.dumps(SCHEMA), json.dumps(SCHEMA_SAMPLE, separators=(",", ":"))),
    "regex": ("regex", REGEX, "March 14, 2024 at 09:30"),
    "choice": ("choice", json.dumps(CHOICES), "mixed (see the comment)"),
    "grammar": ("grammar", EBNF, "(12+3)*4-56/7"),
}


def build_tokenizer(vocab: int = VOCAB):
    """A byte-level BPE of exactly ``vocab`` tokens (Ouro's special tokens at 0, 1, 2)."""
    from transformers import PreTrainedTokenizerFast

    from runtime_glue.ouro import corpus, toy

    base = Path(sysconfig.get_paths()["stdlib"])
    texts = [d.text for d in corpus.documents()]
    for path in sorted(base.rglob("*.py")):  # docs alone give ~27k merges; code fills the rest
        if not corpus._SKIP_DIRS.intersection(path.relative_to(base).parts[:-1]):
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    tok = toy.train_tokenizer(vocab, texts)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
