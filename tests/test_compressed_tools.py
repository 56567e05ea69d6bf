"""compressed-tensors checkpoints proved by the tools that own the format (make
test-compressed, in a venv with the compressed extra: llm-compressor and compressed-tensors).

- llm-compressor's ``oneshot`` with a data-free ``QuantizationModifier`` (W8A16, W4A16,
  W4A16_ASYM)
  quantizes an Ouro checkpoint (the toy writer's, in the real HF layout): rlt-hal loads what
  it writes to exactly the weights compressed-tensors decompresses it to, and generates the
  tokens and logits, bit for bit, of rlt-hal on those decompressed bf16 weights.
- What ``rlt-hal quantize`` writes, compressed-tensors decompresses to the weights rlt-hal
  runs.

The Ouro authors' modeling code does not load in the transformers llm-compressor needs; a
data-free ``QuantizationModifier`` runs no forward, so :class:`OuroShell` (Ouro's modules
under their tensor names, registered with the Auto classes) is all ``oneshot`` and
``save_pretrained`` need.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("llmcompressor", reason="make test-compressed installs llm-compressor")

from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    CompressedTensorsConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from hal.quant import QuantizedWeight  # noqa: E402
from runtime_glue.cli.main import main as cli  # noqa: E402
from runtime_glue.engine.llm import LLM  # noqa: E402
from runtime_glue.engine.sampling import SamplingParams  # noqa: E402
from runtime_glue.ouro.checkpoint import expected_tensors  # noqa: E402
from runtime_glue.ouro.compressed_write import TOKENIZER_FILES  # noqa: E402
from runtime_glue.ouro.config import OuroConfig  # noqa: E402
from runtime_glue.ouro.quantize import checkpoint_tensors  # noqa: E402
from runtime_glue.ouro.toy import preset_config, write_checkpoint  # noqa: E402
from tests.helpers import prompt_of  # noqa: E402

WIDE = dict(hidden_size=128, intermediate_size=256)  # W4A16's group of 128 divides both
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=16, num_blocks=16, mode="hf-exact")


class OuroShellConfig(PretrainedConfig):
    model_type = "ouro"


class _Norm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))


class _Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.self_attn = nn.Module()
        for name, (n, k) in {
            "q_proj": (c.num_attention_heads * d, h),
            "k_proj": (c.num_key_value_heads * d, h),
            "v_proj": (c.num_key_value_heads * d, h),
            "o_proj": (h, c.num_attention_heads * d),
        }.items():
            setattr(self.self_attn, name, nn.Linear(k, n, bias=False))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        for norm in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            setattr(self, norm, _Norm(h))


class OuroShell(PreTrainedModel):
    """Ouro's parameters under their checkpoint names; no forward (none is run)."""

    config_class = OuroShellConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        h = config.hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.model.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.model.norm = _Norm(h)
        self.model.early_exit_gate = nn.Linear(h, 1)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):  # the checkpoint's weights replace every one
        pass


AutoConfig.register("ouro", OuroShellConfig)
AutoModelForCausalLM.register(OuroShellConfig, OuroShell)


@pytest.fixture(scope="module")
def ouro(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ouro"), preset_config("tiny", **WIDE))


def _with_tokenizer(src: Path, dst: Path) -> Path:
    for f in TOKENIZER_FILES:
        if (src / f).is_file() and not (dst / f).exists():
            shutil.copy2(src / f, dst / f)
    return dst


def _decompressed(quantized: Path, out: Path) -> Path:
    """compressed-tensors' own decompression (through transformers' loader), written as a
    bf16 Ouro checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(
        quantized,
        dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    )
    raw = json.loads((quantized / "config.json").read_text())
    raw.pop("quantization_config")
    names = expected_tensors(OuroConfig.from_dict(raw))  # the weights (no scales left over)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n in names}
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    return _with_tokenizer(quantized, out)


def _same_run(a: LLM, b: LLM) -> None:
    prompts = [prompt_of(11, seed=4), prompt_of(6, seed=5)]
    for x, y in zip(
        a.generate(prompts, GREEDY, return_logits=True),
        b.generate(prompts, GREEDY, return_logits=True),
        strict=True,
    ):
        assert list(x.token_ids) == list(y.token_ids)
        assert torch.equal(x.logits, y.logits)


def _weights_equal(llm: LLM, dense: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(dense / "model.safetensors"))
    quantized = 0
    for name, w in checkpoint_tensors(llm.weights).items():
        if isinstance(w, QuantizedWeight):
            quantized += 1
            w = w.dequantize()
        assert torch.equal(w, state[name]), name
    assert quantized


# An asymmetric 8-bit scheme (no preset names one): int8 per group of 128 with zero points.
W8A16_ASYM = {
    "targets": ["Linear"],
    "weights": {
        "num_bits": 8,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": 128,
    },
}


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16", "W4A16_ASYM", "W8A16_ASYM"])
def test_llm_compressor_oneshot_checkpoint_runs_its_decompressed_weights(ouro, tmp_path, scheme):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = AutoModelForCausalLM.from_pretrained(ouro, dtype=torch.bfloat16)
    assert isinstance(model, OuroShell)
    out = tmp_path / scheme
    if scheme == "W8A16_ASYM":
        modifier = QuantizationModifier(config_groups={"group_0": W8A16_ASYM}, ignore=["lm_head"])
    else:
        modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, recipe=modifier, output_dir=str(out))
    _with_tokenizer(ouro, out)
    llm = LLM(out, **ENGINE)
    stored = llm.stored_quantization
    assert stored is not None and stored.bits == int(scheme[1])
    assert stored.zero_points == scheme.endswith("_ASYM")  # 4 bits: int8g holding q - z
    assert (stored.scheme == "int8z") == (scheme == "W8A16_ASYM")  # 8 bits: keeping z
    assert stored.gate  # oneshot quantized the exit gate too: rlt-hal runs it dequantized
    dense = _decompressed(out, tmp_path / "dense")
    _weights_equal(llm, dense)
    _same_run(llm, LLM(dense, **ENGINE))


@pytest.mark.parametrize(
    "scheme,group", [("w8a16", 128), ("w4a16", 32), ("w4a16", 128), ("w8a16-asym", 64)]
)
def test_what_rlt_hal_quantize_writes_decompresses_to_the_weights_rlt_hal_runs(
    ouro, tmp_path, scheme, group
):
    out = tmp_path / "q"
    assert (
        cli(["quantize", str(ouro), str(out), "--scheme", scheme, "--group-size", str(group)]) == 0
    )
    llm = LLM(out, **ENGINE)
    dense = _decompressed(out, tmp_path / "dense")
    _weights_equal(llm, dense)
    _same_run(llm, LLM(dense, **ENGINE))
