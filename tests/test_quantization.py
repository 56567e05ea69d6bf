"""Weight-only int8 and int4 (``--quantization``, ``hal.quant``): the layout, the oracle, and
the guarantees carried over.

- HF-exact mode on quantized weights is the HF reference run on the dequantized weights,
  bit for bit (``runtime_glue.ouro.quantize.dequantized``).
- Deterministic mode keeps its guarantee with quantized kernels: chunked and batched equal
  alone, bit for bit; exact speculation equals plain quantized decoding; step graphs and
  shared decode KV change no bit. On cpu and the emulated npu (a test double of torch_npu,
  never hardware).
- A scheme a driver does not run, or a group size the model's widths do not take, is a
  one-line error before the weights load.
"""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from hal.quant import (
    QuantizedWeight,
    adversarial_qrows,
    adversarial_qweight,
    from_integers,
    quantize,
)
from runtime_glue.checks.reference import OuroReference
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.quantize import (
    checkpoint_tensors,
    dequantized,
    expected_weight_bytes,
    weight_bytes,
)
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

SCHEMES = {
    "int8": dict(quantization="int8"),
    "int8g-g32": dict(quantization="int8g", quantization_group_size=32),
    "int4-g32": dict(quantization="int4"),
    "int8z-g32": dict(quantization="int8z", quantization_group_size=32),
}
# The guarantees' schemes: the weight-only ones, and int8 with its activations quantized per
# token (W8A8 dynamic, what an msModelSlim W8A8_DYNAMIC checkpoint runs).
GUARANTEED = {**SCHEMES, "int8-token": dict(quantization="int8", quantize_activations="token")}
GQA = "gqa-h64-d32-L2-T4"
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def test_int4_packs_input_j_and_j_plus_16_of_each_32_in_one_byte():
    q = torch.arange(64).remainder(16).sub(8).view(1, 64)  # inputs 0..63 -> -8..7 twice
    w = from_integers(q, torch.ones(1, 2), "int4", 32)
    packed = w.qweight[0]
    assert packed.shape == (32,)
    for j in (0, 5, 15, 16, 31):
        base = 32 * (j // 16)
        low, high = q[0, base + j % 16] + 8, q[0, base + j % 16 + 16] + 8
        assert int(packed[j]) == int(low) | int(high) << 4, j
    assert torch.equal(w.integers(), q.to(torch.int8))


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32), ("int4", 128)])
def test_quantize_keeps_weights_within_half_a_step_and_uses_the_whole_range(scheme, group):
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen)).bfloat16()
    qw = quantize(w, scheme, group)
    err = (w.double() - qw.dequantize(torch.float64)).abs()
    step = qw.scales().double().abs()
    q = qw.integers()
    # Q4_0's mapping clamps a weight of the other sign than the group's extreme at 7: within
    # one step there, half a step everywhere else.
    clamped = (q == 7) if scheme == "int4" else torch.zeros_like(q, dtype=torch.bool)
    assert (err[~clamped] <= step[~clamped] / 2 + 1e-12).all()
    assert (err[clamped] <= step[clamped] + 1e-12).all()
    if scheme == "int8":
        assert (q.abs().amax(1) == 127).all()  # each channel's largest weight maps to +-127
    else:  # each group's largest-magnitude weight maps to -8, as llama.cpp's Q4_0
        groups = q.view(48, -1, group)
        assert (groups.min(dim=2).values == -8).all()
    rows = qw.rows(8, 20)
    assert torch.equal(rows.dequantize(), qw.dequantize()[8:20])


def test_asymmetric_int8_keeps_its_zero_points_beside_each_row_and_within_half_a_step():
    """int8z: (q - z) * scale, each group's [min, max] over the 256 levels; a row slice (a
    stacked member) carries its zero points."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(24, 256, generator=gen) + torch.rand(24, 1, generator=gen) * 4).bfloat16()
    qw = quantize(w, "int8z", 64)
    assert qw.qweight.shape == (24, 256 + 4) and qw.zero_points().shape == (24, 4)
    q = qw.qweight[:, :256].to(torch.int16)
    z = qw.zero_points().to(torch.int16).repeat_interleave(64, dim=1)
    assert torch.equal(qw.integers(), q - z)
    assert (q - z).abs().max() > 127  # beyond int8: what int8g could not hold
    err = (w.double() - qw.dequantize(torch.float64)).abs()
    step = qw.scales().double()
    clamped = (q == -128) | (q == 127)
    assert (err[~clamped] <= step[~clamped] / 2 + 1e-12).all()
    assert (err[clamped] <= step[clamped] + 1e-12).all()
    rows = qw.rows(5, 17)
    assert torch.equal(rows.zero_points(), qw.zero_points()[5:17])
    assert torch.equal(rows.dequantize(), qw.dequantize()[5:17])
    with pytest.raises(ValueError, match="zero points must be"):
        from_integers(q, qw.scale, "int8z", 64, zero=torch.full((24, 4), 200))
    with pytest.raises(ValueError, match="take no zero points"):
        from_integers(q, qw.scale, "int8g", 64, zero=qw.zero_points())


def test_quantized_projections_take_their_bytes_and_the_kept_tensors_their_own_memory(tiny_ckpt):
    plain = LLM(tiny_ckpt, block_size=16, num_blocks=8, mode="hf-exact")
    int8 = LLM(tiny_ckpt, block_size=16, num_blocks=8, mode="hf-exact", quantization="int8")
    qkv = int8.weights["model.layers.0.self_attn.qkv_proj.weight"]
    q = int8.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(qkv, QuantizedWeight) and q.qweight.data_ptr() == qkv.qweight.data_ptr()
    assert not isinstance(int8.weights["lm_head.weight"], QuantizedWeight)
    parts = [
        p
        for w in int8.weights.values()
        for p in (w.parts() if isinstance(w, QuantizedWeight) else (w,))
    ]
    storages = {p.untyped_storage().data_ptr() for p in parts}
    assert len(storages) == 1  # one buffer from Device.alloc_weights, as the loader's
    assert parts[0].untyped_storage().nbytes() < weight_bytes(plain.weights)
    own = checkpoint_tensors(int8.weights)
    quantized = [n for n, w in own.items() if isinstance(w, QuantizedWeight)]
    projections = sum(plain.weights[name].nbytes for name in quantized)
    saved = weight_bytes(plain.weights) - weight_bytes(int8.weights)
    assert projections / 2 * 0.9 < saved <= projections / 2


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_hf_exact_quantized_is_the_reference_on_dequantized_weights(tiny_ckpt, scheme):
    """On cpu: the reference kernels are torch's F.linear on every driver."""
    llm = LLM(
        tiny_ckpt,
        block_size=16,
        num_blocks=8,
        mode="hf-exact",
        **SCHEMES[scheme],
    )
    assert llm.plan.mode == "hf-exact" and llm.plan.quantization != "bf16"
    ref = OuroReference(llm.config).load(tiny_ckpt, dequantized(llm.weights))
    plain = OuroReference(llm.config).load(tiny_ckpt)
    for prompt in (prompt_of(13, seed=2), prompt_of(5, seed=3)):
        [out] = llm.generate([prompt], GREEDY, return_logits=True)
        tokens, logits = ref.generate(prompt, GREEDY.max_tokens)
        assert list(out.token_ids) == tokens
        assert torch.equal(out.logits, logits)
        _, bf16_logits = plain.generate(prompt, GREEDY.max_tokens)
        assert not torch.equal(logits, bf16_logits)  # the oracle is not the bf16 model's


def assert_projections_take(llm: LLM, scheme: str, activations: bool | str) -> None:
    """Every quantized projection of the plan runs a kernel of its scheme; one that quantizes
    its activations only when asked to (``--quantize-activations``: True, any; "token", per
    token always)."""
    for kind in ("prompt", "generated"):
        for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            kernel = llm.driver.kernel("linear", llm.plan.choice(kind, op).kernel)
            assert kernel.scheme == scheme, (kind, op, kernel.name)
            if activations == "token":
                assert kernel.activations == "int8-token", (kind, op, kernel.name)
            elif not activations:
                assert kernel.activations == "bf16", (kind, op, kernel.name)


_ENGINES: dict = {}  # (driver, scheme) -> a deterministic engine on the GQA config, built once


def _engine(checkpoints, driver_name, scheme) -> LLM:
    if (driver_name, scheme) not in _ENGINES:
        ckpt = checkpoints(GQA, **PARITY_CONFIGS[GQA])
        _ENGINES[(driver_name, scheme)] = _deterministic(ckpt, driver_name, scheme)
    return _ENGINES[(driver_name, scheme)]


def _deterministic(ckpt, driver_name, scheme, **kw):
    return LLM(
        ckpt,
        device=driver_name,
        block_size=16,
        num_blocks=64,
        mode="deterministic",
        **GUARANTEED[scheme],
        **kw,
    )


@pytest.mark.parametrize("scheme", sorted(GUARANTEED))
def test_deterministic_quantized_chunked_and_batched_equal_alone(checkpoints, driver_name, scheme):
    llm = _engine(checkpoints, driver_name, scheme)
    asked = GUARANTEED[scheme]["quantization"]
    assert llm.plan.deterministic and llm.plan.quantization.startswith(asked[:4])
    assert_projections_take(llm, asked, GUARANTEED[scheme].get("quantize_activations") or False)
    prompts = [prompt_of(40, seed=1), prompt_of(9, seed=2), prompt_of(23, seed=4)]
    together = llm.generate(prompts, GREEDY, return_logits=True)
    config = llm.engine.config
    llm.engine.config = attrs.evolve(config, prefill_chunk_size=7)
    try:
        for prompt, want in zip(prompts, together, strict=True):
            [alone] = llm.generate([prompt], GREEDY, return_logits=True)
            assert alone.token_ids == want.token_ids
            assert torch.equal(alone.logits, want.logits)
    finally:
        llm.engine.config = config


@pytest.mark.parametrize("scheme", sorted(GUARANTEED))
def test_exact_speculation_on_quantized_weights_equals_plain_quantized_decoding(
    checkpoints, driver_name, scheme
):
    from tests.test_speculative import assert_same, jobs_of, run

    llm = _engine(checkpoints, driver_name, scheme)
    want = run(llm, jobs_of(llm))
    spec = llm.with_speculation(2, tokens=3)
    assert_same(run(spec, jobs_of(llm, num_speculative_tokens=3)), want)
    assert spec.engine.stats["spec_verify_steps"] > 0


@pytest.mark.parametrize("scheme", ["int4-g32", "int8-token"])
def test_step_graphs_and_shared_decode_kv_change_no_bit_of_quantized_decoding(checkpoints, scheme):
    ckpt = checkpoints(GQA, **PARITY_CONFIGS[GQA])
    prompts = [prompt_of(21, seed=5), prompt_of(6, seed=6)]
    for sharing in ("none", "last"):
        outs = []
        for graphs in (False, True):
            llm = _deterministic(ckpt, "npu", scheme, kv_sharing=sharing, step_graphs=graphs)
            outs.append(llm.generate(prompts, GREEDY, return_logits=True))
            assert graphs is (llm.engine.graphs is not None)
        for a, b in zip(*outs, strict=True):
            assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits), sharing


def test_a_scheme_the_driver_does_not_run_is_refused_before_the_weights_load(
    tiny_ckpt, monkeypatch
):
    """A driver offering no int4 kernel (the cpu driver's kernels without them)."""
    import runtime_glue.engine.weights as weights_module
    from drivers.cpu.driver import CpuDevice, CpuDriver, CpuEagerBackend, create
    from hal import DriverSpec, ProbeResult, Registry, hookimpl

    kernels = [k for k in create().kernels if k.scheme != "int4" and k.name != "torch"]

    class Plugin:
        @hookimpl
        def rlt_hal_register_drivers(self):
            def make(**_):
                backends = {"cpu_eager": CpuEagerBackend()}
                return CpuDriver("bare", CpuDevice(), backends, "cpu_eager", kernels)

            return [DriverSpec("bare", lambda: ProbeResult(True), make)]

    def loads(*a, **k):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr(weights_module, "load_weights", loads)
    registry = Registry(plugins=[Plugin()], load_entrypoints=False)
    with pytest.raises(ValueError) as err:
        LLM(tiny_ckpt, device="bare", registry=registry, quantization="int4")
    msg = str(err.value)
    assert "\n" not in msg
    assert (
        "driver 'bare' offers no int4 linear kernel" in msg and "runs: int8, int8g, int8z)" in msg
    )


@pytest.mark.parametrize(
    "options,message",
    [
        (
            dict(quantization="int4", quantization_group_size=128),
            "hidden_size (64) is not a multiple of it",
        ),
        (dict(quantization="int4", quantization_group_size=48), "group size must be one of"),
    ],
)
def test_a_group_size_the_model_does_not_take_is_refused_in_one_line(tiny_ckpt, options, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        LLM(tiny_ckpt, **options)
    assert "\n" not in str(err.value)


def test_the_adversarial_quantized_inputs_tell_two_summation_orders_apart():
    gen = torch.Generator().manual_seed(1)
    for scheme, group in (("int8", None), ("int4", 32)):
        w = adversarial_qweight(8, 256, scheme, group, gen)
        x = adversarial_qrows(4, 256, scheme, gen)
        wf = w.dequantize(torch.float32)
        forward = x.float() @ wf.T
        backward = x.float().flip(1) @ wf.flip(1).T
        assert not torch.equal(forward, backward), scheme


def test_the_bench_counts_the_bytes_a_quantized_decode_step_reads(tiny_ckpt):
    """Counted from config.json: int8 projections take a byte per weight and a bf16 scale per
    output channel; the norms and lm_head stay bf16."""
    from runtime_glue.bench import floors

    llm = LLM(tiny_ckpt, block_size=16, num_blocks=8, mode="hf-exact", quantization="int8")
    cfg = llm.config
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    rows_k = [(q_rows, h), (kv_rows, h), (kv_rows, h), (h, q_rows), (i, h), (i, h), (h, i)]
    layer = sum(n * k + 2 * n for n, k in rows_k) + 4 * 2 * h
    want = cfg.total_ut_steps * cfg.num_hidden_layers * layer + 2 * cfg.vocab_size * h
    assert floors.weight_bytes_per_token(cfg, llm.weights) == want
    assert floors.weight_bytes_per_token(cfg) > want  # the bf16 checkpoint's


def test_the_banner_and_metrics_say_the_weights_scheme_and_bytes(tiny_ckpt, capsys):
    from runtime_glue.engine.announce import announce_llm
    from runtime_glue.server.engine_loop import EngineLoop

    llm = LLM(tiny_ckpt, block_size=16, num_blocks=8, mode="hf-exact", quantization="int8")
    loaded = weight_bytes(llm.weights)
    rendered = EngineLoop(llm.engine).metrics.render()
    text = rendered.decode() if isinstance(rendered, bytes) else rendered
    assert f'rlt_hal_weight_bytes{{scheme="int8"}} {float(loaded)}' in text
    announce_llm(llm)
    assert f"weights {loaded / 2**20:.1f} MiB (int8)" in capsys.readouterr().err


def test_a_memory_budget_gives_the_kv_pool_what_the_smaller_weights_leave(tiny_ckpt):
    budget = 8 * 2**20
    pools = {}
    for scheme in (None, "int8", "int4"):
        llm = LLM(tiny_ckpt, block_size=16, mode="hf-exact", memory_budget=budget,
                  quantization=scheme)  # fmt: skip
        lay = llm.kv_layout
        kv = budget - weight_bytes(llm.weights)
        assert lay.num_blocks == kv // (lay.bytes_per_token * 16)
        pools[scheme] = lay.num_blocks
    assert pools[None] < pools["int8"] < pools["int4"]
    with pytest.raises(ValueError, match="--memory-budget cannot be combined with --num-blocks"):
        LLM(tiny_ckpt, memory_budget=budget, num_blocks=4)
    with pytest.raises(ValueError, match="does not hold the weights"):
        LLM(tiny_ckpt, memory_budget=1000)


@pytest.mark.parametrize(
    "scheme, lm_head", [(None, False), ("int8", False), ("int8", True), ("int4", False), ("int4", True)]
)  # fmt: skip
def test_a_budget_the_weights_do_not_fit_is_refused_before_any_weight_loads(
    tiny_ckpt, tiny_config, monkeypatch, scheme, lm_head
):
    """config.json alone gives the bytes the loaded (and quantized) weights take, exactly."""
    q = dict(quantization=scheme, quantization_group_size=64, quantize_lm_head=lm_head)
    if scheme is None:
        q = {}
    need = expected_weight_bytes(tiny_config, scheme, 64, lm_head)
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=4, **q)
    assert weight_bytes(llm.weights) == need
    import runtime_glue.engine.weights as weights_module

    def no_loading(*args, **kw):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(weights_module, "load_weights", no_loading)
    with pytest.raises(ValueError, match=f"does not hold the weights \\({need} bytes"):
        LLM(tiny_ckpt, block_size=16, memory_budget=need, **q)


SCHEME_KEYS = {"int8": "int8", "int8g": "int8g-g32", "int4": "int4-g32"}


@pytest.mark.parametrize("scheme", sorted(SCHEME_KEYS))
def test_kernels_quantizing_activations_run_only_when_asked_and_keep_the_guarantees(
    checkpoints, scheme
):
    """cpu's W8A8 / W4A8 kernels: named with --linear, they need --quantize-activations;
    with it, chunked and batched still equal alone, and exact speculation plain decoding."""
    from tests.test_speculative import assert_same, jobs_of, run

    ckpt = checkpoints(GQA, **PARITY_CONFIGS[GQA])
    name = f"{scheme}-a8-avx2"
    why = _cpu_kernel_missing(name)
    if why is not None:
        pytest.skip(why)
    plain = _deterministic(ckpt, "cpu", SCHEME_KEYS[scheme])
    assert_projections_take(plain, scheme, activations=False)
    llm = _deterministic(ckpt, "cpu", SCHEME_KEYS[scheme], linear=name, quantize_activations=True)
    assert llm.plan.choice("generated", "down_proj").kernel == name
    assert llm.plan.quantization.endswith("+ int8 activations")
    prompts = [prompt_of(40, seed=1), prompt_of(9, seed=2)]
    together = llm.generate(prompts, GREEDY, return_logits=True)
    for prompt, want in zip(prompts, together, strict=True):
        [alone] = llm.generate([prompt], GREEDY, return_logits=True)
        assert alone.token_ids == want.token_ids and torch.equal(alone.logits, want.logits)
    spec = llm.with_speculation(2, tokens=3)
    assert_same(run(spec, jobs_of(llm, num_speculative_tokens=3)), run(llm, jobs_of(llm)))
    with pytest.raises(ValueError, match="needs --quantization"):
        LLM(ckpt, quantize_activations=True)
    with pytest.raises(
        ValueError, match="quantizes its activations .*: add --quantize-activations"
    ):
        LLM(ckpt, linear=name, **SCHEMES[SCHEME_KEYS[scheme]])


def test_per_token_activations_run_only_where_their_arithmetic_is_defined(tiny_ckpt):
    """--quantize-activations token: int8 weights per channel, never with a kernel that takes
    its activations as given, never in HF-exact mode (HF's arithmetic quantizes none)."""
    int8 = dict(quantization="int8", block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="takes int8 weights with one scale per channel"):
        LLM(tiny_ckpt, quantization="int4", quantize_activations="token")
    with pytest.raises(ValueError, match="quantizes no activations"):
        LLM(tiny_ckpt, mode="hf-exact", quantize_activations="token", **int8)
    with pytest.raises(ValueError, match="--linear int8-dequant takes its activations as given"):
        LLM(tiny_ckpt, linear="int8-dequant", quantize_activations="token", **int8)
    with pytest.raises(ValueError, match="add --quantize-activations token"):
        LLM(tiny_ckpt, linear="int8-token-ref", **int8)
    named = LLM(tiny_ckpt, linear="int8-token-ref", quantize_activations="token", **int8)
    assert named.plan.choice("generated", "down_proj").kernel == "int8-token-ref"
    with pytest.raises(ValueError, match="needs --quantization"):
        LLM(tiny_ckpt, quantize_activations="token")


def _cpu_kernel_missing(name: str) -> str | None:
    from drivers.cpu.driver import create

    return create().kernel("linear", name).available()
