"""Checkpoints quantized elsewhere, in compressed-tensors' format (llm-compressor's; vLLM's
``quant_method: compressed-tensors``): read straight into hal.quant's layout, refused by
name where rlt-hal cannot run them. The checkpoints here are written by ``rlt-hal quantize``
and edited; make test-compressed proves the format against compressed-tensors and
llm-compressor themselves (tests/test_compressed_tools.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hal.quant import QuantizedWeight
from runtime_glue.cli.main import QUANTIZE_SCHEMES
from runtime_glue.cli.main import main as cli
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.compressed import pack, unpack
from runtime_glue.ouro.quantize import checkpoint_tensors, expected_weight_bytes, weight_bytes
from tests.helpers import prompt_of

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=16, num_blocks=16, deterministic=True)
WIDE = dict(hidden_size=128, intermediate_size=256)  # int4 group 128 divides both


@pytest.fixture(scope="module")
def wide_ckpt(checkpoints):
    return checkpoints("compressed-wide", **WIDE)


def quantized(src, dst, scheme: str, group: int = 128, *extra: str):
    assert (
        cli(
            ["quantize", str(src), str(dst), "--scheme", scheme, "--group-size", str(group), *extra]
        )
        == 0
    )
    return dst


def test_packing_is_compressed_tensors_word_layout():
    """Value j of a row in bits 4 * (j % 8) of word j // 8 (8 bits: 8 * (j % 4)), stored
    as q + 2^(bits - 1): -8..-1 make the word 0x76543210."""
    q = torch.arange(-8, 0).view(1, 8)
    assert pack(q, 4).tolist() == [[0x76543210]]
    q8 = torch.tensor([[-128, -1, 0, 127]])
    assert int(pack(q8, 8)) % 2**32 == 0x00 | 0x7F << 8 | 0x80 << 16 | 0xFF << 24
    gen = torch.Generator().manual_seed(0)
    for bits, k in ((4, 72), (8, 30)):  # a partial last word, padded
        q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (5, k), generator=gen)
        assert torch.equal(unpack(pack(q, bits), bits, k), q.to(torch.int8))


@pytest.mark.parametrize(
    "scheme,group,lm_head",
    [
        ("w8a16-channel", 128, False),
        ("w8a16", 128, False),
        ("w8a16", 32, True),
        ("w4a16", 32, False),
        ("w4a16", 128, True),
        ("w4a16", 64, False),
        ("w8a8-dynamic", 128, False),
        ("w8a16-asym", 32, False),
    ],
)
def test_a_written_checkpoint_loads_as_the_same_quantization_at_load_time(
    wide_ckpt, tmp_path, scheme, group, lm_head
):
    """The same packed weights and scales, bit for bit, so the same tokens and logits; the
    plan and the byte count say the scheme; the exit gate stays bf16."""
    dst = quantized(wide_ckpt, tmp_path / "q", scheme, group, *(["--lm-head"] if lm_head else []))
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    asked = dict(
        quantization=QUANTIZE_SCHEMES[scheme],
        quantization_group_size=group,
        quantize_lm_head=lm_head,
        quantize_activations="token" if scheme == "w8a8-dynamic" else None,
    )
    at_load = LLM(wide_ckpt, **ENGINE, **asked)
    stored = LLM(dst, **ENGINE)
    assert stored.args.quantization == asked["quantization"]
    assert stored.plan.quantization == at_load.plan.quantization
    assert weight_bytes(stored.weights) == weight_bytes(at_load.weights)
    assert weight_bytes(stored.weights) == expected_weight_bytes(
        stored.config, asked["quantization"], group, lm_head
    )
    mine, theirs = checkpoint_tensors(stored.weights), checkpoint_tensors(at_load.weights)
    assert mine.keys() == theirs.keys()
    for name, w in mine.items():
        other = theirs[name]
        if isinstance(other, QuantizedWeight):
            assert isinstance(w, QuantizedWeight), name
            assert (w.scheme, w.group_size) == (other.scheme, other.group_size), name
            assert torch.equal(w.qweight, other.qweight) and torch.equal(w.scale, other.scale)
        else:
            assert torch.equal(w, other), name
    assert not isinstance(mine["model.early_exit_gate.weight"], QuantizedWeight)
    assert isinstance(mine["lm_head.weight"], QuantizedWeight) == lm_head
    # one buffer, stacked q|k|v a view of it as the load-time path places them
    qkv = stored.weights["model.layers.0.self_attn.qkv_proj.weight"]
    assert (
        stored.weights["model.layers.0.self_attn.k_proj.weight"]
        .qweight.untyped_storage()
        .data_ptr()
        == qkv.qweight.untyped_storage().data_ptr()
    )
    prompts = [prompt_of(11, seed=4), prompt_of(6, seed=5)]
    a = at_load.generate(prompts, GREEDY, return_logits=True)
    b = stored.generate(prompts, GREEDY, return_logits=True)
    for x, y in zip(a, b, strict=True):
        assert list(x.token_ids) == list(y.token_ids)
        assert torch.equal(x.logits, y.logits)


def _edit(src, dst, config=None, tensors=None):
    """A copy of checkpoint ``src`` with ``config(quantization_config)`` and
    ``tensors(state)`` applied."""
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw["quantization_config"])
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


def _group(qc):
    return qc["config_groups"]["group_0"]


@pytest.fixture(scope="module")
def w4(wide_ckpt, tmp_path_factory):
    return quantized(wide_ckpt, tmp_path_factory.mktemp("w4") / "q", "w4a16", 32)


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda qc: qc.update(quant_method="awq"), "quant_method 'awq' is not supported"),
        (lambda qc: qc.update(quant_method="fp8"), "quant_method 'fp8' is not supported"),
        (lambda qc: _group(qc).update(format="float-quantized"), "format 'float-quantized'"),
        (lambda qc: _group(qc)["weights"].update(type="float", num_bits=8), "float weights of 8"),
        (
            lambda qc: _group(qc)["weights"].update(symmetric=False, strategy="tensor"),
            "strategy 'tensor'",
        ),
        (lambda qc: _group(qc)["weights"].update(actorder="group"), "activation ordering"),
        (lambda qc: _group(qc)["weights"].update(strategy="tensor"), "strategy 'tensor'"),
        (lambda qc: _group(qc)["weights"].update(group_size=48), "group size 48"),
        (
            lambda qc: _group(qc).update(input_activations={"num_bits": 8, "type": "int"}),
            "activations quantized as int 8 bits, strategy None",
        ),
        (
            lambda qc: _group(qc).update(
                input_activations={
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "token",
                    "dynamic": True,
                }
            ),
            "activations quantized per token take int8 weights per channel (W8A8), not 4-bit",
        ),
        (
            lambda qc: qc.update(ignore=["lm_head", "re:.*layers[.]1[.]mlp[.]down_proj$"]),
            "'model.layers.1.mlp.down_proj' is not quantized where others are",
        ),
        (lambda qc: qc["config_groups"].update(group_1={}), "has 2 config_groups"),
    ],
)
def test_a_scheme_rlt_hal_does_not_run_is_one_line_naming_it_before_any_weight_loads(
    w4, tmp_path, edit, words
):
    bad = _edit(w4, tmp_path / "bad", config=edit)
    (bad / "model.safetensors").unlink()  # nothing is read: the refusal comes from config.json
    with pytest.raises(ValueError) as err:
        LLM(bad, **ENGINE)
    message = str(err.value)
    assert words in message and str(bad / "config.json") in message and "\n" not in message
    assert "--quantization int8|int8g|int4" in message  # and what would work


def test_the_cli_refuses_it_in_one_line(w4, tmp_path, capsys):
    bad = _edit(w4, tmp_path / "bad", config=lambda qc: qc.update(quant_method="gptq"))
    assert cli(["generate", "--model", str(bad), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlt-hal: error:") and "'gptq'" in err and "\n" not in err


def _scale_rows(state):
    name = "model.layers.0.mlp.up_proj.weight_scale"
    state[name] = state[name][:-1].contiguous()


def _float_scales(state):
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    state[name] = state[name].float() * (1 + 2**-12)  # not a bf16 value any more


def _shape(state):
    state["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([128, 255])


def _packed_dtype(state):
    name = "model.layers.0.self_attn.q_proj.weight_packed"
    state[name] = state[name].to(torch.int64)


def _missing(state):
    del state["model.layers.1.self_attn.v_proj.weight_scale"]


@pytest.mark.parametrize(
    "tensors,names,words",
    [
        (_scale_rows, "model.layers.0.mlp.up_proj.weight_scale", "has shape"),
        (_float_scales, "model.layers.1.self_attn.o_proj.weight_scale", "bf16 cannot hold"),
        (_shape, "model.layers.0.mlp.down_proj.weight_shape", "says [128, 255]"),
        (_packed_dtype, "model.layers.0.self_attn.q_proj.weight_packed", "dtype I64"),
        (_missing, "model.layers.1.self_attn.v_proj.weight_scale", "missing tensor"),
    ],
)
def test_a_tensor_that_does_not_match_the_config_is_named(w4, tmp_path, tensors, names, words):
    bad = _edit(w4, tmp_path / "bad", tensors=tensors)
    with pytest.raises(ValueError) as err:
        LLM(bad, **ENGINE)
    assert names in str(err.value) and words in str(err.value)


def test_per_channel_and_large_group_int4_run_on_the_kernels_group_with_the_same_values(
    wide_ckpt, tmp_path
):
    """A scale per channel (or per 256 inputs) becomes the same scale repeated per 128."""
    w4 = quantized(wide_ckpt, tmp_path / "g128", "w4a16", 128)

    def per_channel(qc):
        _group(qc)["weights"].update(strategy="channel", group_size=None)

    def one_scale_a_row(state):
        for name in [n for n in state if n.endswith("_proj.weight_scale")]:
            state[name] = state[name][:, :1].contiguous()

    channel = _edit(w4, tmp_path / "channel", config=per_channel, tensors=one_scale_a_row)
    llm = LLM(channel, **ENGINE)
    w = llm.weights["model.layers.0.mlp.down_proj.weight"]  # K = 256: two groups of 128
    assert (w.scheme, w.group_size) == ("int4", 128)
    stored = load_file(str(channel / "model.safetensors"))
    assert torch.equal(w.scale, stored["model.layers.0.mlp.down_proj.weight_scale"].expand(-1, 2))
    assert torch.equal(
        w.integers(), unpack(stored["model.layers.0.mlp.down_proj.weight_packed"], 4, 256)
    )
    assert (
        llm.stored_quantization.describe() == "compressed-tensors W4A16 (pack-quantized, channel)"
    )


def test_quantization_asked_of_a_quantized_checkpoint(w4):
    with pytest.raises(ValueError, match="already quantized"):
        LLM(w4, quantization="int8", **ENGINE)
    with pytest.raises(ValueError, match="keeps lm_head in bf16"):
        LLM(w4, quantize_lm_head=True, **ENGINE)
    llm = LLM(w4, quantization="int4", **ENGINE)  # the same scheme: runs as stored
    assert llm.plan.quantization == "int4 (group 32)"


def test_quantize_refuses_to_write_into_a_checkpoint(wide_ckpt, tmp_path, capsys):
    assert cli(["quantize", str(wide_ckpt), str(wide_ckpt), "--scheme", "w8a16"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (
        cli(
            [
                "quantize",
                str(wide_ckpt),
                str(tmp_path / "x"),
                "--scheme",
                "w4a16",
                "--group-size",
                "48",
            ]
        )
        == 2
    )
    assert "group size must be one of" in capsys.readouterr().err


def test_the_start_up_line_says_the_checkpoint_was_quantized_elsewhere(w4, capsys):
    assert cli(["generate", "--model", str(w4), "--prompt", "hi", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert (
        "(int4 (group 32), as stored: compressed-tensors W4A16 (pack-quantized, group 32))" in err
    )


def _zero_points(state, gen, packed=True, bits=4):
    """Random zero points over the whole range of ``bits`` for every projection, as
    compressed-tensors stores them (pack-quantized: packed along the output channels)."""
    half = 1 << (bits - 1)
    for name in [n for n in state if n.endswith("_proj.weight_scale")]:
        z = torch.randint(-half, half, state[name].shape, generator=gen, dtype=torch.int8)
        zp = name.replace("weight_scale", "weight_zero_point")
        state[zp] = pack(z.t(), bits).t().contiguous() if packed else z


@pytest.mark.parametrize(
    "bits,strategy", [(4, "group"), (4, "channel"), (8, "group"), (8, "channel")]
)
def test_asymmetric_weights_run_the_values_compressed_tensors_decompresses(
    wide_ckpt, tmp_path, bits, strategy
):
    """W4A16_ASYM (and 8-bit asymmetric): value (q - z) * scale, computed as
    compressed-tensors' dequantize does (in the scale's dtype, bf16). 4 bits run as int8 per
    group or channel holding q - z, 8 bits as int8z keeping z; in HF-exact mode they generate
    what a bf16 checkpoint of those values does."""
    w4 = quantized(wide_ckpt, tmp_path / "g32", f"w{bits}a16", 32)
    gen = torch.Generator().manual_seed(3)

    def asymmetric(qc):
        _group(qc)["weights"].update(symmetric=False)
        if strategy == "channel":
            _group(qc)["weights"].update(strategy="channel", group_size=None)

    def tensors(state):
        if strategy == "channel":
            for name in [n for n in state if n.endswith("_proj.weight_scale")]:
                state[name] = state[name][:, :1].contiguous()
        _zero_points(state, gen, bits=bits)

    asym = _edit(w4, tmp_path / "asym", config=asymmetric, tensors=tensors)
    hf = dict(block_size=16, num_blocks=16, mode="hf-exact")
    llm = LLM(asym, **hf)
    per = "group 32" if strategy == "group" else "channel"
    assert llm.stored_quantization.describe() == (
        f"compressed-tensors W{bits}A16 (pack-quantized, {per}, asymmetric)"
    )
    stored = load_file(str(asym / "model.safetensors"))
    dense = {}
    for name, w in checkpoint_tensors(llm.weights).items():
        if not isinstance(w, QuantizedWeight):
            dense[name] = w.contiguous()
            continue
        module = name[: -len(".weight")]
        scale = stored[module + ".weight_scale"]
        n, k = w.shape
        q = unpack(stored[module + ".weight_packed"], bits, k)
        z = unpack(stored[module + ".weight_zero_point"].t().contiguous(), bits, n).t()
        g = k // scale.shape[1]
        value = (q.bfloat16() - z.bfloat16().repeat_interleave(g, 1)) * scale.repeat_interleave(
            g, 1
        )
        want = "int8z" if bits == 8 else "int8g" if strategy == "group" else "int8"
        assert w.scheme == want, name
        assert torch.equal(w.dequantize(), value), name
        dense[name] = value
    assert len(dense) == len(checkpoint_tensors(llm.weights))
    plain = tmp_path / "dense"
    shutil.copytree(wide_ckpt, plain)
    save_file(dense, str(plain / "model.safetensors"), metadata={"format": "pt"})
    prompts = [prompt_of(11, seed=4), prompt_of(6, seed=5)]
    a = llm.generate(prompts, GREEDY, return_logits=True)
    b = LLM(plain, **hf).generate(prompts, GREEDY, return_logits=True)
    for x, y in zip(a, b, strict=True):
        assert list(x.token_ids) == list(y.token_ids)
        assert torch.equal(x.logits, y.logits)


def test_asymmetric_zero_points_that_do_not_fit_are_named(w4, tmp_path):
    def asymmetric(qc):
        _group(qc)["weights"].update(symmetric=False)

    def missing(state):
        _zero_points(state, torch.Generator().manual_seed(0))
        del state["model.layers.0.mlp.gate_proj.weight_zero_point"]

    bad = _edit(w4, tmp_path / "missing", config=asymmetric, tensors=missing)
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.weight_zero_point"):
        LLM(bad, **ENGINE)

    def unpacked(state):  # int8 [N, G] where pack-quantized packs it into int32
        _zero_points(state, torch.Generator().manual_seed(0), packed=False)

    bad = _edit(w4, tmp_path / "unpacked", config=asymmetric, tensors=unpacked)
    with pytest.raises(ValueError, match="weight_zero_point"):
        LLM(bad, **ENGINE)
