"""Ouro composed from transformers' own Llama building blocks: the tests' oracle and the
benchmarks' baseline (the peer a user would otherwise run).

The exit gate follows the checkpoint's own modeling code (Ouro's ``OuroForCausalLM``): after
every loop the gate, an ``nn.Linear(H, 1)`` with its bias, scores every position's normed state;
the exit distribution is built in the gate's dtype, loop by loop; a token's logits come from
``exit_at_step``, else the first loop whose cumulative exit probability reaches
``exit_threshold``, else the exit-weighted sum of every loop's logits when asked, else the last
loop, and a request that asks for none gets the config's ``early_exit_step`` and
``early_exit_threshold``. This code is written from those equations on its own: it shares
nothing with the runtime's ``runtime_glue.ouro.exits``.

LlamaRMSNorm, LlamaMLP, LlamaAttention (``eager_attention_forward``), LlamaRotaryEmbedding
(kept in fp32) and a DynamicCache whose layer index is ``t * L + l``: one cache layer per
(loop, layer) plane. It loads the same safetensors as the runtime, and decodes one request
at a time exactly as HF generate does (prefill the prompt, then one token per step, logits
of the last position only).

``kv_sharing="last"`` runs the Ouro paper's last-step reuse (section 5.4.2) through a cache of
its own (``SharedDecodeCache``): the prompt keeps one cache layer per plane, and generated
positions one per layer, which each loop overwrites, so a later token reads the last loop's
K/V; as the runtime pages it, sharing starts at the first KV block after the prompt's (the
generated positions in the prompt's last block keep every plane). It is written from that
definition alone (the runtime's form is ``hal.shared_kv``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file

from runtime_glue.ouro.config import OuroConfig


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


class SharedDecodeCache:
    """The cache ``LlamaAttention`` updates, under decode KV sharing. Until ``sharing`` is set
    (the prompt, and the generated positions that fall in the prompt's last KV block, which
    the runtime keeps in every plane since that block holds them all) a position's K/V goes to
    every plane (layer index ``t * L + l``); after, to one shared entry per layer, appended by
    loop 0 and overwritten by each later loop, and attention at plane ``(t, l)`` sees that
    plane's K/V followed by the shared entries (its own position as this loop just wrote it)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.prompt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sharing = False

    def update(self, key, value, layer_idx, *args, **kwargs):
        if not self.sharing:
            if self.shared:
                raise RuntimeError("a position kept in every plane after shared ones")
            if layer_idx in self.prompt:
                pk, pv = self.prompt[layer_idx]
                key, value = torch.cat((pk, key), dim=-2), torch.cat((pv, value), dim=-2)
            self.prompt[layer_idx] = (key, value)
            return key, value
        t, layer = divmod(layer_idx, self.num_layers)
        if layer not in self.shared:
            k, v = key, value
        elif t == 0:  # a new position
            k = torch.cat((self.shared[layer][0], key), dim=-2)
            v = torch.cat((self.shared[layer][1], value), dim=-2)
        else:  # the same position, a later loop: replaces the previous loop's K/V
            k = torch.cat((self.shared[layer][0][:, :, :-1], key), dim=-2)
            v = torch.cat((self.shared[layer][1][:, :, :-1], value), dim=-2)
        self.shared[layer] = (k, v)
        pk, pv = self.prompt[layer_idx]
        return torch.cat((pk, k), dim=-2), torch.cat((pv, v), dim=-2)


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
        self.early_exit_gate = torch.nn.Linear(H, 1, bias=True)
        self.to(torch.bfloat16)
        # Built after the bf16 cast: a rotary module cast to bf16 rounds inv_freq.
        self.rotary = LlamaRotaryEmbedding(hf)

    def load(
        self, model_dir: str | Path, replaced: dict[str, torch.Tensor] | None = None
    ) -> OuroReference:
        """The checkpoint's weights, with checkpoint tensors in ``replaced`` taken from it
        instead: a quantized model's oracle is the reference on its dequantized weights
        (``runtime_glue.ouro.quantize.dequantized``)."""
        state = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(path)))
        state.update({name: w.cpu() for name, w in (replaced or {}).items()})
        mine = {
            "embed_tokens.weight": state["model.embed_tokens.weight"],
            "norm.weight": state["model.norm.weight"],
            "lm_head.weight": state["lm_head.weight"],
            "early_exit_gate.weight": state["model.early_exit_gate.weight"],
            "early_exit_gate.bias": state["model.early_exit_gate.bias"],
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

    def forward_step(
        self,
        ids: torch.Tensor,
        start: int,
        cache: DynamicCache | SharedDecodeCache,
        exit_rule: tuple = (None, None, False),
    ) -> tuple[torch.Tensor, int]:
        """ids ``[1, S]`` at positions ``start..start+S-1``; returns the last position's logits
        (float32) under ``exit_rule = (exit_at_step, exit_threshold, weighted)``, and the loop
        they came from."""
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
        states: list[torch.Tensor] = []  # the normed state after each loop
        scores: list[torch.Tensor] = []  # the gate's score of it, every position
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
            states.append(h)
            scores.append(self.early_exit_gate(h)[..., 0])  # [1, S]
        return self._exit(states, scores, exit_rule)

    def _exit(self, states, scores, exit_rule) -> tuple[torch.Tensor, int]:
        step, threshold, weighted = exit_rule
        loops = len(states)
        # The exit distribution over loops, every position: l_t = sigmoid(g_t); the mass left
        # after loop t is the product of (1 - l_j) so far; the last loop takes what is left.
        left = torch.ones_like(scores[0])
        per_loop = []
        for t, g in enumerate(scores):
            stop = torch.sigmoid(g)
            per_loop.append(stop * left if t + 1 < loops else left)
            left = left * (1.0 - stop)
        probs = torch.stack(per_loop, dim=-1)  # [1, S, T]
        if step is not None:
            chosen = step
        elif threshold is not None:
            reached = (torch.cumsum(probs, dim=-1) >= threshold)[0, -1]  # the last position
            chosen = int(reached.nonzero()[0]) if bool(reached.any()) else loops - 1
        elif weighted:
            parts = [
                self.lm_head(state[:, -1:, :]) * probs[:, -1:, t : t + 1].to(state.dtype)
                for t, state in enumerate(states)
            ]
            total = parts[0]
            for part in parts[1:]:  # summed in loop order
                total = total + part
            return total[0, -1].float(), loops - 1
        else:
            chosen = loops - 1
        return self.lm_head(states[chosen][:, -1:, :])[0, -1].float(), chosen

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        exit_at_step: int | None = None,
        exit_threshold: float | None = None,
        weighted_exit: bool = False,
        with_exit_steps: bool = False,
        kv_sharing: str = "none",
        block_size: int = 16,
    ):
        """Greedy tokens and the float32 logits each was chosen from (and, when asked, the loop
        each token's logits came from). Without an exit choice, the config's defaults apply.
        ``kv_sharing``: "none" (every plane of every position) or "last" (SharedDecodeCache:
        generated positions from the first ``block_size`` boundary after the prompt on)."""
        rule = (exit_at_step, exit_threshold, weighted_exit)
        if rule == (None, None, False):
            rule = (self.cfg.early_exit_step, self.cfg.early_exit_threshold, False)
        if kv_sharing not in ("none", "last"):
            raise ValueError(f"kv_sharing must be 'none' or 'last', got {kv_sharing!r}")
        cache: DynamicCache | SharedDecodeCache = DynamicCache()
        if kv_sharing == "last":
            cache = SharedDecodeCache(self.cfg.num_hidden_layers)
        dev = self.lm_head.weight.device
        logits, loop = self.forward_step(torch.tensor([prompt_ids], device=dev), 0, cache, rule)
        shared_from = -(-len(prompt_ids) // block_size) * block_size
        tokens, all_logits, loops = [], [], []
        pos = len(prompt_ids)
        for _ in range(max_new_tokens):
            if isinstance(cache, SharedDecodeCache):
                cache.sharing = pos >= shared_from
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            all_logits.append(logits)
            loops.append(loop)
            if len(tokens) == max_new_tokens:
                break
            logits, loop = self.forward_step(torch.tensor([[tok]], device=dev), pos, cache, rule)
            pos += 1
        if with_exit_steps:
            return tokens, torch.stack(all_logits).cpu(), loops
        return tokens, torch.stack(all_logits).cpu()
