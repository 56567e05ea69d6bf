"""Checkpoints in msModelSlim's layout (Ascend's; vllm-ascend's ``--quantization ascend``): a
``quant_model_description.json`` naming each tensor's type, int8 ``weight``, float32
``weight_scale`` and ``weight_offset``; W8A16 (per channel or group), W8A8_DYNAMIC and W8A8
(static: the input's calibrated scale and offset, ``quant_bias``, ``deq_scale``), read into
hal.quant's layout, refused by name where rlt-hal cannot run them. The checkpoints are
written by ``rlt-hal quantize --format msmodelslim`` (the toy writer's checkpoint quantized)
and edited. The npu runs are the EMULATED torch_npu (a CPU test double), never hardware."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hal.quant import QuantizedWeight, static_linear, with_static_input
from runtime_glue.cli.main import main as cli
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro import msmodelslim
from runtime_glue.ouro.msmodelslim import DESCRIPTION, WEIGHTS_FILE
from runtime_glue.ouro.quantize import checkpoint_tensors, expected_weight_bytes, weight_bytes
from tests.helpers import prompt_of

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=16, num_blocks=16, deterministic=True)
WIDE = dict(hidden_size=128, intermediate_size=256)

# --scheme -> (what the same quantization at load time asks, the description's type)
KINDS = {
    "w8a8-dynamic": (dict(quantization="int8", quantize_activations="token"), "W8A8_DYNAMIC"),
    "w8a16-channel": (dict(quantization="int8"), "W8A16"),
    "w8a16": (dict(quantization="int8g", quantization_group_size=32), "W8A16"),
    "w8a16-asym": (dict(quantization="int8z", quantization_group_size=32), "W8A16"),
}


@pytest.fixture(scope="module")
def wide_ckpt(checkpoints):
    return checkpoints("msmodelslim-wide", **WIDE)


def written(src, dst, scheme: str, group: int = 32):
    args = ["quantize", str(src), str(dst), "--scheme", scheme, "--format", "msmodelslim"]
    assert cli([*args, "--group-size", str(group)]) == 0
    return dst


@pytest.fixture(scope="module")
def w8a8(wide_ckpt, tmp_path_factory):
    return written(wide_ckpt, tmp_path_factory.mktemp("w8a8") / "q", "w8a8-dynamic")


def _same_weights(a: dict, b: dict) -> None:
    mine, theirs = checkpoint_tensors(a), checkpoint_tensors(b)
    assert mine.keys() == theirs.keys()
    for name, w in mine.items():
        other = theirs[name]
        if isinstance(other, QuantizedWeight):
            assert isinstance(w, QuantizedWeight), name
            assert (w.scheme, w.group_size) == (other.scheme, other.group_size), name
            assert torch.equal(w.qweight, other.qweight) and torch.equal(w.scale, other.scale)
        else:
            assert torch.equal(w, other), name


@pytest.mark.parametrize("scheme", sorted(KINDS))
def test_the_layout_is_msmodelslims_and_loads_as_the_same_quantization_at_load_time(
    wide_ckpt, tmp_path, scheme
):
    asked, kind = KINDS[scheme]
    dst = written(wide_ckpt, tmp_path / "q", scheme)
    description = json.loads((dst / DESCRIPTION).read_text())
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config  # msModelSlim removes it
    state = load_file(str(dst / WEIGHTS_FILE))
    assert description["model_quant_type"] == kind and set(description) >= set(state)
    q = "model.layers.0.self_attn.q_proj"
    assert state[q + ".weight"].dtype == torch.int8 and state[q + ".weight"].shape == (128, 128)
    grouped = scheme in ("w8a16", "w8a16-asym")
    scales = 128 // 32 if grouped else 1
    assert state[q + ".weight_scale"].dtype == torch.float32
    assert state[q + ".weight_scale"].shape == state[q + ".weight_offset"].shape == (128, scales)
    assert bool(state[q + ".weight_offset"].any()) == (scheme == "w8a16-asym")  # -z
    assert description[q + ".weight"] == kind and description["lm_head.weight"] == "FLOAT"
    assert description["group_size"] == (32 if grouped else 0)

    at_load = LLM(wide_ckpt, **ENGINE, **asked)
    stored = LLM(dst, **ENGINE)
    assert stored.stored_quantization.method == "msModelSlim"
    assert stored.plan.quantization == at_load.plan.quantization
    _same_weights(stored.weights, at_load.weights)
    assert weight_bytes(stored.weights) == expected_weight_bytes(
        stored.config, asked["quantization"], 32, False
    )
    prompts = [prompt_of(11, seed=4), prompt_of(6, seed=5)]
    a = at_load.generate(prompts, GREEDY, return_logits=True)
    b = stored.generate(prompts, GREEDY, return_logits=True)
    for x, y in zip(a, b, strict=True):
        assert list(x.token_ids) == list(y.token_ids) and torch.equal(x.logits, y.logits)


def test_w8a8_dynamic_runs_every_projection_per_token_and_says_so(w8a8, capsys):
    llm = LLM(w8a8, **ENGINE)
    assert llm.args.quantize_activations == "token"
    for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        for kind in ("prompt", "generated"):
            assert llm.driver.kernel("linear", llm.plan.choice(kind, op).kernel).activations == (
                "int8-token"
            )
    assert llm.plan.quantization == "int8 + int8 activations per token"
    assert cli(["generate", "--model", str(w8a8), "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert "as stored: msModelSlim W8A8_DYNAMIC (channel)" in capsys.readouterr().err
    # its weights with bf16 activations (as W8A16), where asked: HF-exact mode's oracle
    plain = LLM(w8a8, quantize_activations="none", mode="hf-exact", block_size=16, num_blocks=16)
    assert plain.plan.mode == "hf-exact" and plain.plan.quantization == "int8"


def test_w8a8_dynamic_loads_and_generates_on_the_emulated_npu(wide_ckpt, w8a8, caplog):
    """The npu driver runs npu_dynamic_quant + npu_quant_matmul (emulated: a test double)
    and gives the tokens and logits of the same quantization at load time on that driver."""
    npu = dict(device="npu", block_size=16, num_blocks=16)
    with caplog.at_level("WARNING"):
        stored = LLM(w8a8, **npu)
        stored.generate([prompt_of(9, seed=1)], GREEDY)
    # its step graphs capture the per-token linears (their layouts are warm-up work)
    assert not [r for r in caplog.records if "step graphs refused" in r.getMessage()]
    at_load = LLM(wide_ckpt, quantization="int8", quantize_activations="token", **npu)
    for op in ("qkv_proj", "down_proj"):
        assert stored.plan.choice("generated", op).kernel == "int8-token-npu"
    prompts = [prompt_of(9, seed=1), prompt_of(5, seed=2)]
    got = stored.generate(prompts, GREEDY, return_logits=True)
    want = at_load.generate(prompts, GREEDY, return_logits=True)
    for x, y in zip(got, want, strict=True):
        assert len(x.token_ids) == GREEDY.max_tokens
        assert list(x.token_ids) == list(y.token_ids) and torch.equal(x.logits, y.logits)


def _edit(src, dst, description=None, tensors=None):
    """A copy of ``src`` with ``description(dict)`` and ``tensors(state)`` applied."""
    shutil.copytree(src, dst)
    if description is not None:
        raw = json.loads((dst / DESCRIPTION).read_text())
        description(raw)
        (dst / DESCRIPTION).write_text(json.dumps(raw))
    if tensors is not None:
        state = load_file(str(dst / WEIGHTS_FILE))
        tensors(state)
        save_file(state, str(dst / WEIGHTS_FILE))
    return dst


def _set(name: str, kind: str):
    return lambda d: d.update({name: kind})


V = "model.layers.1.self_attn.v_proj.weight"


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda d: d.update({k: "W4A16" for k in d if k.endswith("_proj.weight")}),
         "is W4A16, which is not supported"),
        (lambda d: d.update({k: "W4A8_DYNAMIC" for k in d if k.endswith("_proj.weight")}),
         "is W4A8_DYNAMIC, which is not supported"),
        (lambda d: d.update({k: "WFP8AFP8_DYNAMIC" for k in d if k.endswith("_proj.weight")}),
         "is WFP8AFP8_DYNAMIC, which is not supported"),
        (_set(V, "W8A16"), f"{V!r} is W8A16 and"),
        (_set(V, "FLOAT"), f"{V!r} is FLOAT and"),
        (_set("lm_head.weight", "W8A8_DYNAMIC"), "'lm_head.weight' is W8A8_DYNAMIC; only"),
        (lambda d: d.pop(V), f"has no entry for {V!r}"),
    ],
)  # fmt: skip
def test_a_type_rlt_hal_does_not_run_is_one_line_naming_it_before_any_weight_loads(
    w8a8, tmp_path, edit, words
):
    bad = _edit(w8a8, tmp_path / "bad", description=edit)
    (bad / WEIGHTS_FILE).unlink()  # nothing is read: the refusal comes from the description
    with pytest.raises(ValueError) as err:
        LLM(bad, **ENGINE)
    message = str(err.value)
    assert words in message and str(bad / DESCRIPTION) in message and "\n" not in message
    assert "rlt-hal loads msModelSlim W8A16" in message  # and what would work


def test_a_description_that_is_not_json_is_named(w8a8, tmp_path):
    bad = _edit(w8a8, tmp_path / "bad")
    (bad / DESCRIPTION).write_text("{not json")
    with pytest.raises(ValueError, match=f"{DESCRIPTION}: cannot be read as JSON"):
        LLM(bad, **ENGINE)


def _offset(state):
    name = "model.layers.0.mlp.up_proj.weight_offset"
    state[name] = torch.full_like(state[name], 3.0)


def _scale_rows(state):
    name = "model.layers.1.mlp.down_proj.weight_scale"
    state[name] = state[name][:-1].contiguous()


def _weight_dtype(state):
    name = "model.layers.0.self_attn.k_proj.weight"
    state[name] = state[name].to(torch.int16)


def _missing(state):
    del state["model.layers.1.self_attn.o_proj.weight_offset"]


@pytest.mark.parametrize(
    "tensors,names,words",
    [
        (_offset, "model.layers.0.mlp.up_proj.weight_offset", "W8A8_DYNAMIC weights are symm"),
        (_scale_rows, "model.layers.1.mlp.down_proj.weight_scale", "has shape"),
        (_weight_dtype, "model.layers.0.self_attn.k_proj.weight", "dtype I16"),
        (_missing, "model.layers.1.self_attn.o_proj.weight_offset", "missing tensor"),
    ],
)
def test_a_tensor_that_does_not_match_the_description_is_named(
    w8a8, tmp_path, tensors, names, words
):
    bad = _edit(w8a8, tmp_path / "bad", tensors=tensors)
    with pytest.raises(ValueError) as err:
        LLM(bad, **ENGINE)
    assert names in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value)


def test_float32_scales_are_rounded_to_bf16_as_vllm_ascend_loads_them(w8a8, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight_scale"

    def finer(state):
        state[name] = state[name] * (1 + 2**-12)  # no longer a bf16 value

    llm = LLM(_edit(w8a8, tmp_path / "fine", tensors=finer), **ENGINE)
    stored = load_file(str(tmp_path / "fine" / WEIGHTS_FILE))[name]
    w = llm.weights["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(w.scale, stored[:, 0].bfloat16())


def test_quantize_refuses_what_the_msmodelslim_layout_does_not_hold(wide_ckpt, tmp_path, capsys):
    base = ["quantize", str(wide_ckpt), str(tmp_path / "x"), "--format", "msmodelslim"]
    assert cli([*base, "--scheme", "w4a16"]) == 2
    assert "use --format compressed-tensors for --scheme w4a16" in capsys.readouterr().err
    assert cli([*base, "--scheme", "w8a16", "--lm-head"]) == 2
    assert "lm_head in bf16" in capsys.readouterr().err


def test_asymmetric_w8a16_runs_on_the_emulated_npu_with_antiquant_offset(wide_ckpt, tmp_path):
    """(q + weight_offset) * scale on the npu driver: npu_weight_quant_batchmatmul with
    antiquant_offset (EMULATED torch_npu, a test double), the tokens and logits of the same
    int8z quantization at load time there; a fractional offset is named."""
    dst = written(wide_ckpt, tmp_path / "q", "w8a16-asym")
    npu = dict(device="npu", block_size=16, num_blocks=16, mode="fast", linear="int8z-npu")
    stored, at_load = LLM(dst, **npu), LLM(wide_ckpt, **npu, **KINDS["w8a16-asym"][0])
    assert stored.stored_quantization.describe() == "msModelSlim W8A16 (group 32, asymmetric)"
    assert stored.plan.choice("generated", "down_proj").kernel == "int8z-npu"
    _same_weights(stored.weights, at_load.weights)
    prompts = [prompt_of(9, seed=1), prompt_of(5, seed=2)]
    got = stored.generate(prompts, GREEDY, return_logits=True)
    want = at_load.generate(prompts, GREEDY, return_logits=True)
    for x, y in zip(got, want, strict=True):
        assert list(x.token_ids) == list(y.token_ids) and torch.equal(x.logits, y.logits)
    name = "model.layers.1.mlp.gate_proj.weight_offset"

    def fractional(state):
        state[name] = state[name] + 0.5

    with pytest.raises(ValueError, match=f"{name}.*not integers"):
        LLM(_edit(dst, tmp_path / "bad", tensors=fractional), **ENGINE)


# -- W8A8 static ------------------------------------------------------------------------------

# A calibration of each projection's input (scale, offset): q|k|v and gate|up take one input.
CALIBRATION = {
    "q_proj": (2.0**-5, 3),
    "k_proj": (2.0**-5, 3),
    "v_proj": (2.0**-5, 3),
    "o_proj": (2.0**-6, -2),
    "gate_proj": (2.0**-5 * 1.5, 1),
    "up_proj": (2.0**-5 * 1.5, 1),
    "down_proj": (2.0**-7, 0),
}


def static_written(src, dst, calibration=CALIBRATION):
    """A W8A8 (static) checkpoint in msModelSlim's layout (the toy writer's): rlt-hal's int8
    per channel, each projection with its calibrated input and the bias and dequantization
    scale msModelSlim derives from it (``hal.quant.with_static_input``)."""
    weights = LLM(src, quantization="int8", block_size=16, num_blocks=16).weights
    calibrated = {}
    for name, w in checkpoint_tensors(weights).items():
        projection = name.rsplit(".", 2)[-2]
        if isinstance(w, QuantizedWeight):
            w = with_static_input(w, *calibration[projection])
        calibrated[name] = w
    return msmodelslim.write(src, dst, calibrated, "W8A8", 0)


@pytest.fixture(scope="module")
def w8a8_static(wide_ckpt, tmp_path_factory):
    return static_written(wide_ckpt, tmp_path_factory.mktemp("static") / "q")


def test_w8a8_static_layout_loads_with_its_calibrated_inputs_and_runs_them(w8a8_static, capsys):
    state = load_file(str(w8a8_static / WEIGHTS_FILE))
    description = json.loads((w8a8_static / DESCRIPTION).read_text())
    o = "model.layers.1.self_attn.o_proj"
    assert description["model_quant_type"] == "W8A8" and description[o + ".deq_scale"] == "W8A8"
    assert state[o + ".input_scale"].shape == state[o + ".input_offset"].shape == (1,)
    assert state[o + ".quant_bias"].dtype == torch.int32 and state[o + ".quant_bias"].shape == (
        128,
    )
    assert state[o + ".deq_scale"].dtype == torch.float32
    llm = LLM(w8a8_static, **ENGINE)
    assert llm.args.quantize_activations == "static"
    assert llm.plan.quantization == "int8 + int8 activations, static"
    for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        for kind in ("prompt", "generated"):
            kernel = llm.driver.kernel("linear", llm.plan.choice(kind, op).kernel)
            assert kernel.activations == "int8-static"
    w = llm.weights[o + ".weight"]
    assert float(w.static.scale[0]) == 2.0**-6 and float(w.static.offset[0]) == -2
    assert torch.equal(w.static.bias, state[o + ".quant_bias"])
    assert torch.equal(w.static.deq_scale, state[o + ".deq_scale"])
    k = llm.weights["model.layers.0.self_attn.k_proj.weight"]  # a member of the stacked q|k|v
    assert torch.equal(k.static.bias, state["model.layers.0.self_attn.k_proj.quant_bias"])
    qkv = llm.weights["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.static.bias.shape == (qkv.shape[0],)
    assert (
        cli(["generate", "--model", str(w8a8_static), "--prompt", "hi", "--max-tokens", "2"]) == 0
    )
    assert "as stored: msModelSlim W8A8 (channel)" in capsys.readouterr().err


def test_w8a8_static_projection_is_its_float64_arithmetic():
    """``static_linear`` against float64: q = clamp(rint(x * bf16(1 / scale) + offset)), the
    sums of (q - offset) * weight exact, times input_scale * weight_scale."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (24, 200), generator=gen)
    from hal.quant import from_integers

    w = with_static_input(from_integers(q, torch.rand(24, generator=gen) / 64, "int8"), 0.02, -5)
    x = (torch.randn(7, 200, generator=gen) * 1.5).bfloat16()
    inv = torch.tensor(1 / torch.tensor(0.02).bfloat16().double().item()).bfloat16().double()
    xq = torch.round(x.double() * inv - 5).clamp(-128, 127)
    assert ((x.double() * inv - 5).abs() > 127).any()  # some inputs saturate
    exact = ((xq + 5) @ q.double().T) * w.static.scale.double() * w.scale.double()
    got = static_linear(x, w).double()
    assert ((got - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all()
    assert not torch.equal(got, static_linear(x, with_static_input(w, 0.02, 0)).double())


def test_w8a8_static_gives_the_same_tokens_alone_and_batched(w8a8_static):
    prompts = [prompt_of(9, seed=1), prompt_of(5, seed=2)]
    cpu = LLM(w8a8_static, **ENGINE)
    both = cpu.generate(prompts, GREEDY, return_logits=True)
    for x, p in zip(both, prompts, strict=True):
        y = cpu.generate([p], GREEDY, return_logits=True)[0]
        assert len(x.token_ids) == GREEDY.max_tokens
        assert list(x.token_ids) == list(y.token_ids) and torch.equal(x.logits, y.logits)


def test_w8a8_static_on_the_emulated_npu_is_the_reference_arithmetic_in_captured_steps(
    w8a8_static, caplog
):
    """The npu driver (EMULATED torch_npu, a test double) runs npu_quantize +
    npu_quant_matmul with quant_bias and deq_scale inside its captured step graphs, and gives
    the tokens and logits of the same engine on hal.quant.static_linear."""
    npu = dict(device="npu", block_size=16, num_blocks=16)
    prompts = [prompt_of(9, seed=1), prompt_of(5, seed=2)]
    with caplog.at_level("WARNING"):
        own = LLM(w8a8_static, **npu)
        got = own.generate(prompts, GREEDY, return_logits=True)
    assert not [r for r in caplog.records if "step graphs refused" in r.getMessage()]
    for op in ("qkv_proj", "down_proj"):
        assert own.plan.choice("generated", op).kernel == "int8-static-npu"
    reference = LLM(w8a8_static, linear="int8-static-ref", **npu)
    want = reference.generate(prompts, GREEDY, return_logits=True)
    for x, y in zip(got, want, strict=True):
        assert list(x.token_ids) == list(y.token_ids) and torch.equal(x.logits, y.logits)


def test_w8a8_static_refusals_name_the_option_or_the_tensor(wide_ckpt, w8a8, w8a8_static, tmp_path):
    with pytest.raises(ValueError, match="this checkpoint is msModelSlim W8A8_DYNAMIC"):
        LLM(w8a8, quantize_activations="static", **ENGINE)
    with pytest.raises(ValueError, match="this checkpoint is not quantized"):
        LLM(wide_ckpt, quantization="int8", quantize_activations="static", **ENGINE)
    with pytest.raises(ValueError, match="Hugging Face's arithmetic quantizes no activations"):
        LLM(w8a8_static, mode="hf-exact", block_size=16, num_blocks=16)
    plain = LLM(w8a8_static, quantize_activations="none", mode="hf-exact", block_size=16,
                num_blocks=16)  # fmt: skip
    assert plain.plan.quantization == "int8"  # its weights with bf16 activations (W8A16)
    k = "model.layers.1.self_attn.k_proj"

    def k_apart(state):
        state[k + ".input_scale"] = state[k + ".input_scale"] * 2

    def half_offset(state):
        state[k + ".input_offset"] = torch.tensor([2.5])

    for edit, words in ((k_apart, f"{k}.weight: input_scale"), (half_offset, "not an int8")):
        bad = _edit(w8a8_static, tmp_path / edit.__name__, tensors=edit)
        with pytest.raises(ValueError, match=words) as err:
            LLM(bad, **ENGINE)
        assert "\n" not in str(err.value)


def test_exact_speculation_on_a_w8a8_static_checkpoint_equals_plain_decoding(w8a8_static):
    """Speculation with the early loops as the draft, on the calibrated W8A8 projections: the
    tokens and logits of plain decoding (deterministic mode)."""
    from tests.test_speculative import assert_same, jobs_of, run

    llm = LLM(w8a8_static, block_size=16, num_blocks=64, mode="deterministic")
    assert llm.plan.quantization == "int8 + int8 activations, static"
    want = run(llm, jobs_of(llm))
    spec = llm.with_speculation(2, tokens=3)
    assert_same(run(spec, jobs_of(llm, num_speculative_tokens=3)), want)
    assert spec.engine.stats["spec_verify_steps"] > 0
