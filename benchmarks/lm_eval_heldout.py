"""A multiple-choice task from the trained checkpoint's held-out text, for lm-evaluation-harness.

No dataset hub is reachable here, so the task is written from what the trained preset held
out of its corpus (``runtime_glue.ouro.corpus``: Python's reference manual and docstrings, one
document in ten by a fixed rule on its name): each question is a passage's first words and
its true next words among three continuations taken from other held-out passages. Writes
``OUT/heldout_mc.jsonl`` and ``OUT/rlt_hal_heldout_mc.yaml``; run it with
``INCLUDE_PATH=OUT benchmarks/lm_eval.sh RESULTS rlt_hal_heldout_mc``.

Usage: python benchmarks/lm_eval_heldout.py OUT [--questions 200] [--context 24] [--answer 6]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from runtime_glue.ouro.corpus import documents, split


def passages(context: int, answer: int) -> list[tuple[str, str]]:
    """(context words, continuation words) of every held-out document long enough."""
    _, held = split(documents())
    out = []
    for doc in held:
        words = doc.text.split()
        for start in range(0, len(words) - context - answer, context + answer):
            ctx = " ".join(words[start : start + context])
            out.append((ctx, " " + " ".join(words[start + context : start + context + answer])))
    return out


def build(questions: int, context: int, answer: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pool = passages(context, answer)
    rng.shuffle(pool)
    rows = []
    for i, (ctx, true) in enumerate(pool[:questions]):
        others = [pool[(i + k * 97) % len(pool)][1] for k in (1, 2, 3)]
        choices = [true, *others]
        rng.shuffle(choices)
        rows.append({"question": ctx, "choices": choices, "gold": choices.index(true)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--context", type=int, default=24, help="words of context")
    parser.add_argument("--answer", type=int, default=6, help="words of each continuation")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "heldout_mc.jsonl"
    rows = build(args.questions, args.context, args.answer)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "rlt_hal_heldout_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    (args.out / "rlt_hal_heldout_mc.yaml").write_text(json.dumps(task, indent=1))
    print(f"{len(rows)} questions from held-out text in {data}")


if __name__ == "__main__":
    main()
