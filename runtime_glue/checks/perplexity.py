"""``rlt-hal eval --perplexity``: held-out perplexity and next-token accuracy per exit mode,
computed by rlt-hal's runtime (``OuroModel.forward`` on the checkpoint as loaded), so that the
figures are the runtime's, not the training code's.

The held-out text is ``runtime_glue.ouro.corpus``'s (the documents its fixed rule holds out),
tokenized by the checkpoint's own tokenizer and cut into windows of ``seq_len + 1`` tokens;
each window is one sequence from position 0, scored at every position. Per exit mode: every
fixed loop, the checkpoint's threshold, weighted, and adaptive depth (decode rows leaving
after their exit loop), the last teacher-forced one token at a time, as decoding runs it.
For each loop, the fraction of positions whose argmax equals the last loop's: the number
that bounds how often a draft from that loop is accepted. Under ``--kv-sharing last``, also
the mode's cost against full KV (``runtime_glue.checks.kv_sharing_eval``).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from hal.types import AttentionMetadata, KVAddressing
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.step import sequence_inputs
from runtime_glue.ouro import corpus
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.records import StepInputs
from runtime_glue.ouro.toy import TRAINING_FILE, write_files
from runtime_glue.ouro.train import TrainOuro, init_weights, windows


def training_record(model_dir: Path) -> dict | None:
    path = Path(model_dir) / TRAINING_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def encoder(tokenizer):
    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return encode


def heldout_windows(
    tokenizer, sources: Sequence[str], seq_len: int, max_tokens: int
) -> tuple[torch.Tensor, list[int]]:
    """The held-out windows ``[W, seq_len + 1]`` (at most ``max_tokens`` scored positions) and
    the training stream's ids (for the unigram baseline)."""
    train_docs, held_docs = corpus.split(corpus.documents(sources))
    encode = encoder(tokenizer)
    held = corpus.token_stream(encode, held_docs)
    return windows(held, seq_len)[: max(1, max_tokens // seq_len)], corpus.token_stream(
        encode, train_docs
    )


class Scorer:
    """Runs the runtime's model over one sequence at a time, in KV blocks it borrows from the
    engine's pool (and gives back)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def _step(self, ids: Sequence[int], ctx: int, blocks, prompt: bool, modes) -> StepInputs:
        n, cfg = len(ids), self.llm.config
        alloc = self.llm.allocator
        slots = alloc.num_blocks * alloc.block_size
        meta = AttentionMetadata.build(alloc.block_size, [(n, ctx, blocks)], slots)
        kv = KVAddressing.uniform(meta, cfg.num_hidden_layers, slots)
        dev = self.llm.driver.device.torch_device
        return sequence_inputs(dev, kv, list(ids), ctx, prompt, list(modes), cfg.total_ut_steps)

    def _blocks(self, tokens: int) -> list[int]:
        alloc = self.llm.allocator
        blocks = alloc.allocate(alloc.blocks_for(tokens))
        if blocks is None:
            raise RuntimeError(f"the KV pool cannot hold a window of {tokens} tokens now")
        return blocks

    def prefill(self, ids: Sequence[int], mode: ExitMode) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (float32 ``[S, V]``) and exit loops ``[S]`` of every position, one step."""
        blocks = self._blocks(len(ids))
        try:
            out = self.llm.model.forward(self._step(ids, 0, blocks, True, [mode] * len(ids)))
            logits, chosen = out.logits, out.chosen
        finally:
            self.llm.allocator.free_after(blocks, None)
        return logits.float().cpu(), chosen.cpu()

    def decode(self, ids: Sequence[int], mode: ExitMode) -> tuple[torch.Tensor, torch.Tensor]:
        """The same, teacher-forced one position a step, each a decode row (as generation
        runs them; adaptive depth acts on such rows only)."""
        blocks = self._blocks(len(ids))
        out, loops = [], []
        try:
            for p, token in enumerate(ids):
                step = self._step([token], p, blocks, False, [mode])
                result = self.llm.model.forward(step)
                logits, chosen = result.logits, result.chosen
                out.append(logits.float().cpu())
                loops.append(chosen.cpu())
        finally:
            self.llm.allocator.free_after(blocks, None)
        return torch.cat(out), torch.cat(loops)


def write_initial_checkpoint(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """``model_dir``'s model as training starts it (random weights, the recipe's seed), with
    the same config and tokenizer: the "same model with random weights" baseline."""
    llm_cfg = OuroConfig.from_dir(model_dir)
    model = TrainOuro(llm_cfg)
    init_weights(model, torch.Generator().manual_seed(seed))
    write_files(out, llm_cfg, model.bf16_weights())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(model_dir) / name, Path(out) / name)
    return Path(out)


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    return float(F.cross_entropy(logits, targets, reduction="sum")), int(
        (logits.argmax(-1) == targets).sum()
    )


def _figures(nll: float, correct: int, tokens: int) -> dict:
    return {"perplexity": math.exp(nll / tokens), "ce": nll / tokens, "accuracy": correct / tokens}


def fixed_and_gated(scorer: Scorer, held: torch.Tensor, threshold: float | None) -> dict:
    """Every fixed loop, the threshold and weighted exits, over ``windows``, one prefill each."""
    T = scorer.llm.config.total_ut_steps
    modes = {f"loop {t}": ExitMode(step=t) for t in range(T)}  # 0-based, as exit_at_step
    if threshold is not None:
        modes[f"threshold {threshold}"] = ExitMode(threshold=threshold)
    modes["weighted"] = ExitMode(weighted=True)
    sums = {name: [0.0, 0, 0] for name in modes}  # nll, correct, agree with the last loop
    exits = torch.zeros(T, dtype=torch.int64)
    tokens = 0
    for window in held:
        ids, targets = window[:-1].tolist(), window[1:]
        argmax = {}
        for name, mode in modes.items():
            logits, chosen = scorer.prefill(ids, mode)
            nll, correct = _score(logits, targets)
            sums[name][0] += nll
            sums[name][1] += correct
            argmax[name] = logits.argmax(-1)
            if mode.kind == "threshold":
                exits += torch.bincount(chosen, minlength=T)
        last = argmax[f"loop {T - 1}"]
        for name in modes:
            sums[name][2] += int((argmax[name] == last).sum())
        tokens += len(ids)
    report = {
        name: {**_figures(nll, int(correct), tokens), "agreement_with_last_loop": agree / tokens}
        for name, (nll, correct, agree) in sums.items()
    }
    if threshold is not None:
        hist = (exits.double() / tokens).tolist()
        report[f"threshold {threshold}"]["exit_loop_histogram"] = hist  # loop t at index t
        report[f"threshold {threshold}"]["mean_exit_loop"] = sum(t * f for t, f in enumerate(hist))
    return {"tokens": tokens, "modes": report}


def adaptive(llm: LLM, held: torch.Tensor, threshold: float) -> dict:
    """Adaptive depth against full compute under ``threshold``, teacher-forced decode rows."""
    full, adaptive_depth = (
        Scorer(llm.variant(adaptive_depth=False)),
        Scorer(llm.variant(adaptive_depth=True)),
    )
    mode = ExitMode(threshold=threshold)
    nll = {"full": 0.0, "adaptive": 0.0}
    correct = {"full": 0, "adaptive": 0}
    same = loops = tokens = 0
    for window in held:
        ids, targets = window[:-1].tolist(), window[1:]
        f_logits, _ = full.decode(ids, mode)
        a_logits, a_loops = adaptive_depth.decode(ids, mode)
        for name, logits in (("full", f_logits), ("adaptive", a_logits)):
            n, c = _score(logits, targets)
            nll[name] += n
            correct[name] += c
        same += int((f_logits.argmax(-1) == a_logits.argmax(-1)).sum())
        loops += int((a_loops + 1).sum())
        tokens += len(ids)
    return {
        "tokens": tokens,
        "threshold": threshold,
        "full_compute": _figures(nll["full"], correct["full"], tokens),
        "adaptive_depth": _figures(nll["adaptive"], correct["adaptive"], tokens),
        "argmax_agreement_with_full_compute": same / tokens,
        "mean_loops_run": loops / tokens,
    }


def perplexity(
    llm: LLM,
    seq_len: int | None = None,
    max_tokens: int | None = None,
    adaptive_tokens: int = 2048,
    random_baseline: LLM | None = None,
    kv_sharing_tokens: int = 2048,
) -> dict:
    """The report of ``rlt-hal eval --perplexity`` (see the module docstring). Window length
    and token count default to the checkpoint's training record, else 128 and 16384."""
    record = training_record(llm.model_dir)
    recipe = (record or {}).get("recipe", {})
    seq_len = seq_len or recipe.get("seq_len", 128)
    max_tokens = max_tokens or recipe.get("eval_tokens", 16384)
    sources = recipe.get("sources", corpus.SOURCES)
    held, train_ids = heldout_windows(llm.tokenizer, sources, seq_len, max_tokens)
    threshold = llm.plan.exit_defaults.threshold or llm.config.early_exit_threshold
    report = {
        "checkpoint": str(llm.model_dir),
        "device": llm.driver.label,
        "plan": llm.plan.describe(),
        "seq_len": seq_len,
        "split": corpus.SPLIT_RULE,
        "sources": list(sources),
        **fixed_and_gated(Scorer(llm), held, threshold),
        "unigram": corpus.unigram_perplexity(
            train_ids, held[:, 1:].flatten().tolist(), llm.config.vocab_size
        ),
    }
    if threshold is not None and adaptive_tokens > 0:
        report["adaptive"] = adaptive(llm, held[: max(1, adaptive_tokens // seq_len)], threshold)
    if llm.args.kv_sharing == "last" and kv_sharing_tokens > 0:
        from runtime_glue.checks.kv_sharing_eval import kv_sharing_quality

        some = held[: max(1, kv_sharing_tokens // seq_len)]
        report["kv_sharing"] = kv_sharing_quality(llm, some, prefix=seq_len // 4)
    if random_baseline is not None:
        last = ExitMode(step=llm.config.total_ut_steps - 1)
        scorer, nll, correct = Scorer(random_baseline), 0.0, 0
        for window in held:
            n, c = _score(scorer.prefill(window[:-1].tolist(), last)[0], window[1:])
            nll, correct = nll + n, correct + c
        report["random_weights"] = _figures(nll, correct, report["tokens"])
    if record is not None:
        report["training"] = {k: record[k] for k in ("recipe_hash", "train_seconds", "held_out")}
    return report


def markdown_perplexity(report: dict) -> str:
    lines = [
        f"held-out tokens: {report['tokens']} (windows of {report['seq_len']}), {report['split']}",
        "",
        "| exit mode | perplexity | next-token accuracy | argmax = last loop's |",
        "|---|---|---|---|",
    ]
    for name, r in report["modes"].items():
        lines.append(
            f"| {name} | {r['perplexity']:.2f} | {r['accuracy']:.1%} | "
            f"{r['agreement_with_last_loop']:.1%} |"
        )
    for name, r in report["modes"].items():
        if "mean_exit_loop" in r:
            hist = ", ".join(f"{f:.1%}" for f in r["exit_loop_histogram"])
            lines.append(f"\n{name}: mean exit loop {r['mean_exit_loop']:.2f} (loops 0..: {hist})")
    if "adaptive" in report:
        a = report["adaptive"]
        lines.append(
            f"adaptive depth (threshold {a['threshold']}, {a['tokens']} teacher-forced decode "
            f"tokens): perplexity {a['adaptive_depth']['perplexity']:.2f} vs "
            f"{a['full_compute']['perplexity']:.2f} with every loop run; argmax equal to full "
            f"compute's {a['argmax_agreement_with_full_compute']:.1%}; "
            f"{a['mean_loops_run']:.2f} loops run per token"
        )
    lines.append(
        f"unigram model of the training text: perplexity {report['unigram']['perplexity']:.2f}"
    )
    if "kv_sharing" in report:
        from runtime_glue.checks.kv_sharing_eval import markdown_kv_sharing

        lines.append(markdown_kv_sharing(report["kv_sharing"]))
    if "random_weights" in report:
        lines.append(
            f"the same model at initialisation (random weights): perplexity "
            f"{report['random_weights']['perplexity']:.2f}"
        )
    return "\n".join(lines)
