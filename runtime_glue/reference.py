"""Ouro composed from transformers' own Llama building blocks: the tests' oracle and the
benchmarks' baseline (the peer a user would otherwise run).

LlamaRMSNorm, LlamaMLP, LlamaAttention (``eager_attention_forward``), LlamaRotaryEmbedding
(kept in fp32) and a DynamicCache whose layer index is ``t * L + l``: one cache layer per
(loop, layer) plane. It loads the same safetensors as the runtime, and decodes one request
at a time exactly as HF generate does (prefill the prompt, then one token per step, logits
of the last position only).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file

from runtime_glue.config import OuroConfig


def _raised_in_torch_npu(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if "torch_npu" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


try:
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )
except (ImportError, OSError, RuntimeError) as exc:
    # transformers' modeling code imports torch_npu whenever it is installed; on a host without
    # the Ascend stack that import fails, and with it this module. (The runtime never imports
    # transformers' modeling code: only this reference does.)
    if not _raised_in_torch_npu(exc):
        raise
    raise RuntimeError(
        f"the HF-module reference imports transformers' modeling code, which imports the "
        f"installed torch_npu, and that failed ({exc}): source CANN's set_env.sh where the "
        f"Ascend stack is installed, or uninstall torch-npu where it is not"
    ) from exc


def _cache_keyword() -> str:
    """The keyword ``LlamaAttention.forward`` takes its KV cache by: ``cache`` from transformers
    5.24, ``past_key_values`` from 5.0. Passing the wrong one is silently swallowed by its
    ``**kwargs`` and the reference runs without its KV history, so refuse instead."""
    params = inspect.signature(LlamaAttention.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RuntimeError(
        "this transformers' LlamaAttention.forward takes no cache argument "
        f"({', '.join(params)}); the reference needs transformers >= 5.0"
    )


CACHE_KEYWORD = _cache_keyword()
NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)


class OuroReference(torch.nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hf = LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=False,
            mlp_bias=False,
            hidden_act="silu",
        )
        hf._attn_implementation = "eager"
        L, H, eps = cfg.num_hidden_layers, cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, H)
        self.attn = torch.nn.ModuleList(LlamaAttention(hf, i) for i in range(L))
        self.mlp = torch.nn.ModuleList(LlamaMLP(hf) for _ in range(L))
        self.norms = torch.nn.ModuleList(
            torch.nn.ModuleDict({n: LlamaRMSNorm(H, eps) for n in NORMS}) for _ in range(L)
        )
        self.norm = LlamaRMSNorm(H, eps)
        self.lm_head = torch.nn.Linear(H, cfg.vocab_size, bias=False)
        self.to(torch.bfloat16)
        # Built after the bf16 cast: a rotary module cast to bf16 rounds inv_freq.
        self.rotary = LlamaRotaryEmbedding(hf)

    def load(self, model_dir: str | Path) -> OuroReference:
        state = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(path)))
        mine = {
            "embed_tokens.weight": state["model.embed_tokens.weight"],
            "norm.weight": state["model.norm.weight"],
            "lm_head.weight": state["lm_head.weight"],
        }
        for i in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                mine[f"attn.{i}.{proj}.weight"] = state[p + f"self_attn.{proj}.weight"]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                mine[f"mlp.{i}.{proj}.weight"] = state[p + f"mlp.{proj}.weight"]
            for n in NORMS:
                mine[f"norms.{i}.{n}.weight"] = state[p + f"{n}.weight"]
        self.load_state_dict(mine, strict=True)
        return self

    def forward_step(self, ids: torch.Tensor, start: int, cache: DynamicCache) -> torch.Tensor:
        """ids ``[1, S]`` at positions ``start..start+S-1``; returns last-position logits."""
        cfg, s = self.cfg, ids.shape[1]
        h = self.embed_tokens(ids)  # [1, S, H]
        dev = h.device
        pos = torch.arange(start, start + s, device=dev)[None]
        cos_sin = self.rotary(h, pos)
        kv_len = start + s
        allowed = torch.arange(kv_len, device=dev)[None, :] <= (
            torch.arange(s, device=dev)[:, None] + start
        )
        mask = torch.zeros(s, kv_len, dtype=h.dtype, device=dev).masked_fill(
            ~allowed, torch.finfo(h.dtype).min
        )[None, None]
        for t in range(cfg.total_ut_steps):
            for i in range(cfg.num_hidden_layers):
                n = cast(torch.nn.ModuleDict, self.norms[i])
                attn = cast(LlamaAttention, self.attn[i])
                attn.layer_idx = t * cfg.num_hidden_layers + i
                a, _ = attn(
                    n["input_layernorm"](h),
                    position_embeddings=cos_sin,
                    attention_mask=mask,
                    **{CACHE_KEYWORD: cache},
                )
                h = h + n["input_layernorm_2"](a)
                m = self.mlp[i](n["post_attention_layernorm"](h))
                h = h + n["post_attention_layernorm_2"](m)
            h = self.norm(h)
        return self.lm_head(h[:, -1:, :])[0, -1].float()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        """Greedy tokens and the float32 logits each was chosen from."""
        cache = DynamicCache()
        dev = self.lm_head.weight.device
        logits = self.forward_step(torch.tensor([prompt_ids], device=dev), 0, cache)
        tokens, all_logits = [], []
        pos = len(prompt_ids)
        for _ in range(max_new_tokens):
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            all_logits.append(logits)
            if len(tokens) == max_new_tokens:
                break
            logits = self.forward_step(torch.tensor([[tok]], device=dev), pos, cache)
            pos += 1
        return tokens, torch.stack(all_logits).cpu()
