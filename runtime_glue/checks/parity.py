"""The divergence locator: run one request two ways and find where they first differ.

Two ways can be two drivers, two attention backends, or full vs chunked prefill on one
driver. Both runs record every intermediate (loop, layer, op) tensor for every position the
two share; the report names the first differing generated token and the first
(loop, layer, op) in forward order whose values differ, with the position and the size of
the difference.
"""

from __future__ import annotations

from collections import defaultdict

import attrs
import torch

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

OPS = ("q_proj", "k_proj", "v_proj", "attention", "mlp", "residual")


@attrs.frozen
class Divergence:
    loop: int
    layer: int
    op: str
    position: int  # first token position whose values differ
    max_abs_diff: float
    max_abs_value: float

    def describe(self) -> str:
        return (
            f"loop {self.loop}, layer {self.layer}, {self.op} (position {self.position}): "
            f"max |a - b| = {self.max_abs_diff:.4g} (max |a| = {self.max_abs_value:.4g})"
        )


@attrs.frozen
class ParityReport:
    a: str
    b: str
    equal: bool
    tokens_a: tuple[int, ...]
    tokens_b: tuple[int, ...]
    first_token_diff: int | None  # index into the generated tokens
    max_logit_diff: float
    first_divergence: Divergence | None

    def to_json(self) -> dict:
        return attrs.asdict(self)

    def describe(self) -> str:
        lines = [f"{self.a}  vs  {self.b}: {'EQUAL' if self.equal else 'DIFFERENT'}"]
        if self.first_token_diff is not None:
            i = self.first_token_diff
            lines.append(
                f"first differing generated token: #{i} "
                f"({self.tokens_a[i] if i < len(self.tokens_a) else None} vs "
                f"{self.tokens_b[i] if i < len(self.tokens_b) else None})"
            )
        lines.append(f"max |logit difference| over shared steps: {self.max_logit_diff:.4g}")
        if self.first_divergence is not None:
            lines.append(f"first difference: {self.first_divergence.describe()}")
        elif not self.equal:
            lines.append(
                "no recorded intermediate differs (the difference is in lm_head or sampling)"
            )
        return "\n".join(lines)


class _Recorder:
    """Collects ``[rows, ...]`` float32 tensors per (loop, layer, op), rows in step order."""

    def __init__(self) -> None:
        self.parts: dict[tuple[int, int, str], list[torch.Tensor]] = defaultdict(list)

    def __call__(self, loop: int, layer: int, op: str, value: torch.Tensor) -> None:
        self.parts[(loop, layer, op)].append(value.detach().float().cpu())

    def tensor(self, key) -> torch.Tensor:
        return torch.cat(self.parts[key])


def _run(llm: LLM, prompt: list[int], max_tokens: int):
    rec = _Recorder()
    llm.model.recorder = rec
    try:
        out = llm.generate(
            [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True), return_logits=True
        )[0]
    finally:
        llm.model.recorder = None
    return out, rec


def _first_divergence(rec_a: _Recorder, rec_b: _Recorder, rows: int, cfg) -> Divergence | None:
    for t in range(cfg.total_ut_steps):
        for li in range(cfg.num_hidden_layers):
            for op in OPS:
                a = rec_a.tensor((t, li, op))[:rows]
                b = rec_b.tensor((t, li, op))[:rows]
                differs = (a != b).any(dim=-1)  # NaN != NaN counts as a difference too
                if bool(differs.any()):
                    pos = int(torch.nonzero(differs)[0])
                    diff = float((a - b).abs().max())
                    return Divergence(t, li, op, pos, diff, float(a.abs().max()))
    return None


@attrs.frozen
class ToleranceCheck:
    """Two greedy runs of one prompt held to a tolerance instead of to equal bits."""

    passed: bool
    parted_at: int | None  # the first step whose tokens differ
    max_logit_diff: float  # over the steps both runs fed the same tokens
    near_tie: bool  # where they parted, B's pick was within the tolerance of A's best


def within_tolerance(tokens_a, logits_a, tokens_b, logits_b, tolerance: float) -> ToleranceCheck:
    """Logits within ``tolerance`` while both runs are fed the same tokens, and tokens that part
    only where B picked a token within ``tolerance`` of A's best (a near-tie, where the last
    bits decide the argmax)."""
    n = min(len(tokens_a), len(tokens_b))
    parted = next((i for i in range(n) if tokens_a[i] != tokens_b[i]), None)
    fed_alike = n if parted is None else parted + 1
    diff = float((logits_a[:fed_alike] - logits_b[:fed_alike]).abs().max()) if fed_alike else 0.0
    near_tie = True
    if parted is not None:
        near_tie = float(logits_a[parted].max() - logits_a[parted][tokens_b[parted]]) <= tolerance
    same_length = len(tokens_a) == len(tokens_b)
    return ToleranceCheck(diff <= tolerance and near_tie and same_length, parted, diff, near_tie)


def compare(
    llm_a: LLM,
    llm_b: LLM,
    prompt: list[int],
    max_tokens: int = 16,
    label_a: str = "a",
    label_b: str = "b",
) -> ParityReport:
    """Greedy-run ``prompt`` on both and locate the first difference."""
    if llm_a.config != llm_b.config:
        raise ValueError("the two runs must load the same checkpoint config")
    out_a, rec_a = _run(llm_a, prompt, max_tokens)
    out_b, rec_b = _run(llm_b, prompt, max_tokens)
    ta, tb = out_a.token_ids, out_b.token_ids
    first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
    shared = first + 1 if first is not None else len(ta)  # steps fed identical inputs
    logit_diff = float((out_a.logits[:shared] - out_b.logits[:shared]).abs().max())
    # Positions fed identical tokens in both runs: the prompt and the tokens before `first`.
    rows = len(prompt) + (first if first is not None else len(ta) - 1)
    divergence = _first_divergence(rec_a, rec_b, rows, llm_a.config)
    equal = first is None and logit_diff == 0.0 and divergence is None
    return ParityReport(label_a, label_b, equal, ta, tb, first, logit_diff, divergence)
