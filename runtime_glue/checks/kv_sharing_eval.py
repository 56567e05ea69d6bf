"""What ``--kv-sharing last`` costs in quality: held-out perplexity and greedy agreement with
full KV, through the runtime's own model (``rlt-hal eval --perplexity --kv-sharing last``).

Each held-out window is split as a request would be: its first ``prefix`` tokens are the
prompt (prefilled, every plane kept), the rest are generated positions, teacher-forced one a
step, as decoding runs them; their K/V is kept in full or in shared planes (``hal.shared_kv``).
Only the generated positions are scored, the only ones sharing changes. Greedy agreement:
from the same prompts, each mode generates on its own; the fraction of positions whose token
is the same, and how long the two agree from the start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hal.shared_kv import build_shared_addressing, prompt_blocks
from hal.types import AttentionMetadata, KVAddressing
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.shared_blocks import SharedBlocks
from runtime_glue.engine.step import sequence_inputs
from runtime_glue.ouro.exits import ExitMode


class SequenceRunner:
    """One sequence at a time through ``llm.model``, in blocks borrowed from its pool."""

    def __init__(self, llm: LLM, sharing: bool) -> None:
        self.llm, self.sharing = llm, sharing
        self.alloc = llm.allocator
        loops = llm.config.total_ut_steps
        self.shared = llm.placement.generated or SharedBlocks(self.alloc, loops)

    def _logits(self, ids: Sequence[int], ctx: int, kv: KVAddressing, prompt: bool):
        """The last row's logits (float32 ``[1, V]``) of one step of ``ids`` at ``ctx``."""
        cfg, n = self.llm.config, len(ids)
        step = sequence_inputs(
            self.llm.driver.device.torch_device, kv, list(ids), ctx, prompt,
            [ExitMode()], cfg.total_ut_steps, [n - 1],
        )  # fmt: skip
        return self.llm.model.forward(step).logits.float().cpu()

    def _addressing(self, n: int, ctx: int, blocks, P: int, gen) -> KVAddressing:
        cfg, bs, nb = self.llm.config, self.alloc.block_size, self.alloc.num_blocks
        if self.sharing:
            request = (n, ctx, blocks, P, gen)
            return build_shared_addressing(
                bs, [request], nb, cfg.num_hidden_layers, cfg.total_ut_steps
            )
        meta = AttentionMetadata.build(bs, [(n, ctx, blocks)], nb * bs)
        return KVAddressing.uniform(meta, cfg.num_hidden_layers, nb * bs)

    def run(self, prompt: list[int], follow: list[int] | None, new: int) -> torch.Tensor:
        """Logits (float32 ``[new, V]``) of the prompt's last position and of ``new - 1``
        generated positions: ``follow``'s tokens (teacher-forced) or the greedy ones."""
        bs, P = self.alloc.block_size, len(prompt)
        total = self.alloc.blocks_for(P + new)
        own = prompt_blocks(P, bs) if self.sharing else total
        blocks = self.alloc.allocate(own)
        gen = self.shared.allocate(total - own) if self.sharing else []
        if blocks is None or gen is None:
            raise RuntimeError(f"the KV pool cannot hold a sequence of {P + new} tokens now")
        out = []
        try:
            out.append(self._logits(prompt, 0, self._addressing(P, 0, blocks, P, gen), True))
            for g in range(new - 1):
                token = follow[g] if follow is not None else int(out[-1].argmax(-1))
                kv = self._addressing(1, P + g, blocks, P, gen)
                out.append(self._logits([token], P + g, kv, False))
        finally:
            self.alloc.free_after(blocks, None)
            if gen:
                self.shared.free_after(gen, None)
        return torch.cat(out)


def kv_sharing_quality(llm: LLM, held: torch.Tensor, prefix: int) -> dict:
    """Perplexity of the generated positions with full and shared decode KV, and agreement."""
    runners = {"none": SequenceRunner(llm, False), "last": SequenceRunner(llm, True)}
    nll = dict.fromkeys(runners, 0.0)
    correct = dict.fromkeys(runners, 0)
    same_argmax = same_greedy = common = tokens = 0
    for window in held:
        ids = window.tolist()
        prompt, follow, new = ids[:prefix], ids[prefix:-1], len(ids) - prefix
        targets = window[prefix:]
        argmax, greedy = {}, {}
        for name, runner in runners.items():
            logits = runner.run(prompt, follow, new)
            nll[name] += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct[name] += int((logits.argmax(-1) == targets).sum())
            argmax[name] = logits.argmax(-1)
            greedy[name] = runner.run(prompt, None, new).argmax(-1)
        same_argmax += int((argmax["none"] == argmax["last"]).sum())
        agree = greedy["none"] == greedy["last"]
        same_greedy += int(agree.sum())
        common += int(agree.long().cumprod(0).sum())
        tokens += new
    return {
        "windows": len(held),
        "prompt_tokens": prefix,
        "generated_tokens_per_window": len(held[0]) - prefix,
        "scored_tokens": tokens,
        **{
            f"{name}_kv": {
                "perplexity": math.exp(nll[name] / tokens),
                "accuracy": correct[name] / tokens,
            }
            for name in runners
        },
        "teacher_forced_argmax_agreement": same_argmax / tokens,
        "greedy_token_agreement": same_greedy / tokens,
        "greedy_mean_common_prefix": common / len(held),
    }


def markdown_kv_sharing(r: dict) -> str:
    return (
        f"kv sharing last ({r['windows']} windows: {r['prompt_tokens']} prompt + "
        f"{r['generated_tokens_per_window']} generated tokens, teacher-forced): perplexity of the "
        f"generated positions {r['last_kv']['perplexity']:.3f} vs {r['none_kv']['perplexity']:.3f} "
        f"with full KV; argmax agreement {r['teacher_forced_argmax_agreement']:.1%}; free greedy "
        f"generation: {r['greedy_token_agreement']:.1%} of tokens equal, "
        f"{r['greedy_mean_common_prefix']:.1f} tokens equal from the start on average"
    )
