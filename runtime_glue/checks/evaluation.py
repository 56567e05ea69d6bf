"""``rlt-hal eval``: an accuracy comparison of two configurations on a question set.

Questions come from a JSONL file, one ``{"id", "question", "answers": [...]}`` per line. Each
side decodes every question greedily from the same prompt template, with the same stopping
(the first EOS token, then the first line of text), and an answer is right when, normalised
(lowercase, no punctuation, articles or extra spaces), it equals one of the reference answers.
The report gives each side's exact-match accuracy, how the two agree (both right, only A, only
B, both wrong), how many outputs are token for token identical, and every question's outputs.

A side is rlt-hal on a device (``LLMSide``) or the HF-module reference on a device
(``ReferenceSide``): rlt-hal on an NPU against the reference on the same NPU, or against cpu.
"""

from __future__ import annotations

import json
import re
import string
from importlib import resources
from pathlib import Path
from typing import Protocol

import attrs
import torch

from runtime_glue.engine.sampling import SamplingParams

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"


def sample_questions() -> Path:
    """The question set shipped with rlt-hal (general knowledge and arithmetic)."""
    return Path(str(resources.files("runtime_glue") / "data" / "questions.jsonl"))


@attrs.frozen
class Question:
    id: str
    question: str
    answers: tuple[str, ...]


def load_questions(path: str | Path) -> list[Question]:
    """Parse a JSONL question file; an error names the line and the field at fault."""
    questions = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from None
        for field, kind in (("id", (str, int)), ("question", str), ("answers", list)):
            if not isinstance(raw.get(field), kind):
                raise ValueError(f"{path}:{n}: field {field!r} is missing or of the wrong type")
        if not raw["answers"] or not all(isinstance(a, str) for a in raw["answers"]):
            raise ValueError(f"{path}:{n}: 'answers' must be a non-empty list of strings")
        questions.append(Question(str(raw["id"]), raw["question"], tuple(raw["answers"])))
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


class Side(Protocol):
    name: str
    eos_token_ids: frozenset[int]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]: ...


class LLMSide:
    """rlt-hal: every prompt in one batch (its mode's contract keeps each prompt's tokens)."""

    def __init__(self, llm, name: str | None = None) -> None:
        self.llm = llm
        self.name = name or f"rlt-hal {llm.driver.label} ({llm.plan.mode})"
        self.eos_token_ids = frozenset(llm.config.eos_token_ids)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return [list(out.token_ids) for out in self.llm.generate(prompts, params)]


class ReferenceSide:
    """The HF-module reference (transformers' Llama modules), one prompt at a time."""

    def __init__(self, reference, device: torch.device | str) -> None:
        self.reference = reference
        self.name = f"HF-module reference ({device})"
        self.eos_token_ids = frozenset(reference.cfg.eos_token_ids)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [self.reference.generate(p, max_tokens)[0] for p in prompts]


def _answer(tokenizer, ids: list[int], eos: frozenset[int]) -> tuple[list[int], str]:
    """The tokens up to the first EOS, and the first line of their text, stripped."""
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    text = tokenizer.decode(ids[:cut], skip_special_tokens=True)
    return ids[:cut], text.strip().split("\n")[0].strip()


def evaluate(
    tokenizer,
    questions: list[Question],
    side_a: Side,
    side_b: Side,
    template: str = DEFAULT_TEMPLATE,
    max_tokens: int = 16,
) -> dict:
    prompts = [
        tokenizer.encode(template.format(question=q.question), add_special_tokens=False)
        for q in questions
    ]
    outs = {"a": side_a.greedy(prompts, max_tokens), "b": side_b.greedy(prompts, max_tokens)}
    rows, counts = [], {"both_right": 0, "only_a": 0, "only_b": 0, "both_wrong": 0}
    for i, q in enumerate(questions):
        row: dict = {"id": q.id, "question": q.question, "answers": list(q.answers)}
        right = {}
        for key, side in (("a", side_a), ("b", side_b)):
            ids, text = _answer(tokenizer, outs[key][i], side.eos_token_ids)
            right[key] = normalize(text) in {normalize(a) for a in q.answers}
            row[f"output_{key}"], row[f"correct_{key}"], row[f"tokens_{key}"] = (
                text,
                right[key],
                ids,
            )
        row["identical"] = row["tokens_a"] == row["tokens_b"]
        kind = {(1, 1): "both_right", (1, 0): "only_a", (0, 1): "only_b", (0, 0): "both_wrong"}
        counts[kind[(right["a"], right["b"])]] += 1
        rows.append(row)
    n = len(questions)
    return {
        "a": side_a.name,
        "b": side_b.name,
        "template": template,
        "max_tokens": max_tokens,
        "questions": n,
        "accuracy_a": sum(r["correct_a"] for r in rows) / n,
        "accuracy_b": sum(r["correct_b"] for r in rows) / n,
        "agreement": counts,
        "identical_outputs": sum(r["identical"] for r in rows),
        "results": rows,
    }


def markdown_evaluation(report: dict) -> str:
    agree = report["agreement"]
    lines = [
        f"A: {report['a']}\nB: {report['b']}\n",
        "| questions | accuracy A | accuracy B | both right | only A | only B | both wrong | "
        "identical outputs |",
        "|---|---|---|---|---|---|---|---|",
        f"| {report['questions']} | {report['accuracy_a']:.1%} | {report['accuracy_b']:.1%} | "
        f"{agree['both_right']} | {agree['only_a']} | {agree['only_b']} | {agree['both_wrong']} | "
        f"{report['identical_outputs']} |",
        "\n| id | A | B | right A/B |",
        "|---|---|---|---|",
    ]
    for r in report["results"]:
        mark = f"{'y' if r['correct_a'] else 'n'}/{'y' if r['correct_b'] else 'n'}"
        lines.append(f"| {r['id']} | {r['output_a']!r} | {r['output_b']!r} | {mark} |")
    return "\n".join(lines)
