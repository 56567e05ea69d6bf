"""Training a small Ouro here: the model in plain differentiable torch, the stage-I objective,
and the loop (seeded, deterministic on one machine at a fixed thread count).

The module mirrors the checkpoint's layout, so its ``state_dict`` names are the HF tensor
names and the weights it writes load through ``runtime_glue.ouro.checkpoint`` unchanged:

    h = embed(ids)
    for t in 0..T-1:                             # the same L layers every loop
        for l in 0..L-1:
            h = h + ln2_l(attn_l(ln_l(h)))       # sandwich norms around both blocks
            h = h + post_ln2_l(mlp_l(post_ln_l(h)))
        h = norm(h)                              # h_t, after every loop
        logits_t, gate_t = lm_head(h), early_exit_gate(h)

Stage I (DESIGN.md, "Training objective"): ``sum_t p_t * L_t - beta * H(p)`` per position,
averaged, with ``p`` the gate's exit distribution (``runtime_glue.ouro.exits.exit_pdf``) and
``L_t`` the next-token loss of loop ``t``. The gate learns with the model.

It computes in fp32; the checkpoint stores bf16. The runtime's figures therefore differ from
this forward's by bf16 rounding only (tests/test_trained.py states the tolerance).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import exit_pdf
from runtime_glue.ouro.progress import TrainingProgress

RECIPE_VERSION = 1  # bump when the code changes what a recipe trains


@attrs.frozen(kw_only=True)
class Recipe:
    """Everything that decides the trained weights (with the model's config)."""

    steps: int = 500
    batch: int = 32  # sequences per step
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta: float = 0.05  # the entropy bonus of stage I
    seed: int = 0
    threads: int = 2  # the thread count fixes the reduction order: part of determinism
    sources: tuple[str, ...] = ("topics", "stdlib")
    eval_tokens: int = 16384  # held-out tokens the training code reports on

    def digest(self, cfg: OuroConfig) -> str:
        """A hash of this recipe, the model's config and the code's version."""
        text = json.dumps(
            {"recipe": attrs.asdict(self), "config": cfg.to_hf_dict(), "v": RECIPE_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.d).transpose(1, 2)  # [B, Hq, S, d]
        k = self.k_proj(x).view(B, S, self.kv_heads, self.d).transpose(1, 2)  # [B, Hkv, S, d]
        v = self.v_proj(x).view(B, S, self.kv_heads, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, Hq, S, d]
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm, self.input_layernorm_2 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Body(nn.Module):
    """``model.*`` of the checkpoint."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)


class TrainOuro(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [B, S]`` -> every loop's logits ``[T, B, S, V]`` and gate values ``[T, B, S]``."""
        S = ids.shape[1]
        freqs = torch.arange(S, dtype=torch.float32)[:, None] * self.inv_freq  # [S, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # [S, d], broadcast over [B, H, S, d]
        h = self.model.embed_tokens(ids)  # [B, S, H]
        logits, gates = [], []
        for _ in range(self.cfg.total_ut_steps):
            for layer in self.model.layers:
                h = layer(h, cos, sin)
            h = self.model.norm(h)
            logits.append(self.lm_head(h))
            gates.append(self.model.early_exit_gate(h)[..., 0])
        return torch.stack(logits), torch.stack(gates)

    def bf16_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in self.state_dict().items()}


def stage1_loss(
    logits: torch.Tensor, gates: torch.Tensor, targets: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective and each loop's mean next-token loss ``[T]`` (detached)."""
    T = logits.shape[0]
    ce = F.cross_entropy(  # [T, B*S]
        logits.flatten(1, 2).flatten(0, 1), targets.flatten().repeat(T), reduction="none"
    ).view(T, -1)
    pdf = exit_pdf(gates.flatten(1))  # [B*S, T]
    entropy = -(pdf * torch.log(pdf.clamp_min(1e-12))).sum(-1)  # [B*S]
    loss = (pdf * ce.T).sum(-1) - beta * entropy
    return loss.mean(), ce.mean(-1).detach()


def windows(ids: Sequence[int], seq_len: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows of ``seq_len + 1`` tokens ``[W, seq_len + 1]``."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"the text has {len(ids)} tokens; a window needs seq_len + 1 = {seq_len + 1}"
        )
    t = torch.tensor(ids[: n * seq_len + 1], dtype=torch.int64)
    return torch.stack([t[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


def init_weights(model: TrainOuro, gen: torch.Generator) -> None:
    """Normal(0, 0.02) matrices (the residual outputs scaled by 1/sqrt(2 * L * T)), unit norms,
    a zero gate bias."""
    depth = 2 * model.cfg.num_hidden_layers * model.cfg.total_ut_steps
    for name, p in model.named_parameters():
        if p.dim() == 1:  # norm weights (ones, as constructed) and the gate's bias
            if name == "model.early_exit_gate.bias":
                nn.init.zeros_(p)
            continue
        residual = name.endswith(("o_proj.weight", "down_proj.weight"))
        std = 0.02 / math.sqrt(depth) if residual else 0.02
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _lr(recipe: Recipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    cfg: OuroConfig,
    recipe: Recipe,
    train_ids: Sequence[int],
    progress: TrainingProgress | None = None,
) -> tuple[TrainOuro, dict]:
    """Train from scratch; the model, and a record of the run (losses, timing). ``progress``
    shows each step (default: nothing)."""
    progress = progress or TrainingProgress(enabled=False)
    torch.set_num_threads(recipe.threads)
    gen = torch.Generator().manual_seed(recipe.seed)
    model = TrainOuro(cfg)
    init_weights(model, gen)
    data = windows(train_ids, recipe.seq_len)
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": rest, "weight_decay": 0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    history: list[dict] = []
    start = time.perf_counter()
    progress.start(recipe.steps)
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(recipe, step)
        batch = data[torch.randint(len(data), (recipe.batch,), generator=gen)]
        logits, gates = model(batch[:, :-1])
        loss, per_loop = stage1_loss(logits, gates, batch[:, 1:], recipe.beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        history.append(
            {"step": step, "loss": float(loss.detach()), "ce_per_loop": per_loop.tolist()}
        )
        progress.step(step, history[-1]["loss"])
    progress.close()
    seconds = time.perf_counter() - start
    record = {
        "train_seconds": seconds,
        "steps_per_s": recipe.steps / seconds,
        "train_windows": len(data),
        "train_tokens": len(train_ids),
        "first_loss": history[0]["loss"],
        "final_loss": sum(h["loss"] for h in history[-10:]) / len(history[-10:]),
        "history": history[:: max(1, recipe.steps // 100)],
    }
    return model, record


@torch.no_grad()
def loop_losses(model: TrainOuro, data: torch.Tensor, batch: int = 8) -> dict:
    """The training forward's mean next-token loss per loop, and its exit distribution's mean,
    over ``data [W, S + 1]``: the training code's own figures (the runtime's are in
    ``runtime_glue.checks.perplexity``)."""
    T = model.cfg.total_ut_steps
    total, pdf_sum, count = torch.zeros(T, dtype=torch.float64), torch.zeros(T), 0
    for i in range(0, len(data), batch):
        chunk = data[i : i + batch]
        logits, gates = model(chunk[:, :-1])
        targets = chunk[:, 1:].flatten()
        for t in range(T):
            total[t] += F.cross_entropy(logits[t].flatten(0, 1), targets, reduction="sum")
        pdf_sum += exit_pdf(gates.flatten(1)).sum(0)
        count += targets.numel()
    ce = (total / count).tolist()
    return {
        "tokens": count,
        "ce_per_loop": ce,
        "perplexity_per_loop": [math.exp(c) for c in ce],
        "mean_exit_pdf": (pdf_sum / count).tolist(),
    }
