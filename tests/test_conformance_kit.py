"""The conformance kit: the example third-party driver passes it, a broken driver fails it."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

from tests.helpers import rlt_hal


def _kit(driver: str, env=None):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "hal.testing",
            "--rlt-driver",
            driver,
        ],
        capture_output=True,
        text=True,
        env=env,
    )


def test_the_example_driver_is_registered_only_through_its_entry_point():
    [ep] = [ep for ep in entry_points(group="rlt_hal") if ep.name == "acme"]
    assert ep.value == "rlt_hal_acme.plugin" and ep.dist.name == "rlt-hal-acme"
    code = (
        "import sys; from hal.registry import Registry; assert 'rlt_hal_acme' not in "
        "sys.modules; print(Registry().names)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "'acme'" in out.stdout, out.stderr


def test_the_example_driver_is_selected_with_vllm_rlt_device(tiny_ckpt):
    env = {**os.environ, "VLLM_RLT_DEVICE": "acme"}
    proc = rlt_hal(
        "generate",
        "--model",
        str(tiny_ckpt),
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "3",
        "--json",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"device": "acme"' in proc.stdout and '"attention_backend": "acme_eager"' in proc.stdout


def test_the_example_driver_passes_the_kit():
    proc = _kit("acme")
    assert proc.returncode == 0, proc.stdout[-3000:]
    import hal.testing

    checks = 0
    for module in pkgutil.iter_modules(hal.testing.__path__):
        if module.name.startswith("test_"):
            found = importlib.import_module(f"hal.testing.{module.name}")
            checks += sum(name.startswith("test_") for name in vars(found))
    assert re.search(rf"\b{checks} passed\b", proc.stdout)  # every check ran: none skipped


BROKEN = '''
import torch
import torch.nn.functional as F
from hal import DriverSpec, Kernel, ProbeResult, hookimpl
from hal.eager import EagerBackend, TensorKVStore, eager_attention
from drivers.cpu.driver import CpuDevice, CpuDriver


class LeakyBackend(EagerBackend):
    """Forgets the causal mask: every query sees the whole gathered context."""
    name = "leaky"

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        _, heads, n, d = query.shape
        out = query.new_empty(n, heads * d)
        for s in meta.seqs:
            k, v = kv.gather(plane, s.kv_slots)
            q = query[:, :, s.query_start : s.query_start + s.query_len]
            o = eager_attention(q, k, v, scaling, context_len=s.kv_len)
            out[s.query_start : s.query_start + s.query_len] = o.reshape(s.query_len, -1)
        return out


class NudgedBackend(EagerBackend):
    """Claims HF's bits but scales each call's last row by 1 + 2^-7 (about an ulp): the same
    greedy tokens, other logits, in every run."""
    name = "nudged"

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        out = super().forward(query, plane, kv, meta, scaling, deterministic)
        out[-1:] = (out[-1:].float() * (1 + 2**-7)).to(out.dtype)
        return out


class MisboundBackend(EagerBackend):
    """Correct, except that its bound form (AttentionBackend.bind) writes K/V a plane late."""
    name = "misbound"

    def bind(self, kv, meta, scaling, deterministic):
        bound = super().bind(kv, meta, scaling, deterministic)
        late = lambda plane, k, v: bound.write((plane + 1) % kv.layout.num_planes, k, v)
        return type(bound)(late, bound.attend)


def tailless(x, w):
    """Drops K's tail beyond a multiple of 8."""
    k = x.shape[-1] // 8 * 8
    return F.linear(x[..., :k], w[:, :k])


def widthwise(x, w):
    """Exact on narrow weights; zeroes a column of wide (stacked) ones."""
    y = F.linear(x, w)
    if w.shape[0] > 100:
        y[..., -1] = 0
    return y


def batchwise(x, w):
    """Sums a row in another order when the call holds 13 rows. (Otherwise one row at a time,
    so that the only call shape where a row's bits change is 13, whatever path a CPU's GEMM
    library takes for one row or many.)"""
    if x.shape[0] != 13:
        return torch.stack([F.linear(row, w) for row in x])
    half = x.shape[-1] // 2
    return (F.linear(x[:, :half].float(), w[:, :half].float())
            + F.linear(x[:, half:].float(), w[:, half:].float())).to(x.dtype)


def wrong_group(x, w):
    """int4: applies a row's first group's scale to its second group."""
    import attrs
    from hal.quant import dequantized_linear

    scale = w.scale.clone()
    scale[:, 1] = scale[:, 0]
    return dequantized_linear(x, attrs.evolve(w, scale=scale, forms={}))


def biasless(x, w):
    """W8A8 static without quant_bias (the input's offset never taken back out)."""
    import attrs
    from hal.quant import static_linear

    static = attrs.evolve(w.static, bias=torch.zeros_like(w.static.bias))
    return static_linear(x, attrs.evolve(w, static=static, forms={}))


def one_rounding(q, k, cos, sin):
    """Rotary with the sum of both products rounded once (as a fused multiply-add would)."""
    from hal.kernels import rotate_half

    def turn(x):
        c, s = cos[:, None].float(), sin[:, None].float()
        return (x.float() * c + rotate_half(x).float() * s).to(x.dtype)

    return turn(q), turn(k)


def off_by_a_row(w):
    """A bound form (Kernel.into) that reads the weight's rows shifted by one."""
    shifted = w.roll(1, 0)

    def call(out, x):
        out[: x.shape[0]] = F.linear(x, shifted)

    return call


KERNELS = [
    Kernel("rotary", "oneround", one_rounding, hf_exact=True),
    Kernel("linear", "boundwrong", F.linear, into=off_by_a_row),
    Kernel("linear", "tailless", tailless),
    Kernel("linear", "widthwise", widthwise, column_invariant=True),
    Kernel("linear", "batchwise", batchwise, row_invariant=True),
    Kernel("linear", "wronggroup", wrong_group, scheme="int4"),
    Kernel("linear", "biasless", biasless, scheme="int8", activations="int8-static"),
]


@hookimpl
def rlt_hal_register_drivers():
    def make(**_):
        return CpuDriver(
            "leaky", CpuDevice(),
            {"nudged": NudgedBackend(), "leaky": LeakyBackend(), "misbound": MisboundBackend()},
            "leaky",
            KERNELS,
        )

    return [DriverSpec("leaky", lambda: ProbeResult(True), make)]
'''


def test_a_driver_that_leaks_future_positions_or_breaks_its_linear_claims_fails_the_kit(tmp_path):
    """Planted bugs: a leaky mask, a dropped K tail, a zeroed stacked column, a row summed
    differently in one call shape, an int4 kernel reading a wrong group's scale, a W8A8
    static kernel that drops quant_bias, a rotary kernel that claims HF's bits but rounds
    once, a bound linear (Kernel.into) that reads the wrong rows, an attention backend whose
    bound form writes a plane late, and one that claims HF's bits but moves a row by an ulp."""
    (tmp_path / "leaky_driver.py").write_text(textwrap.dedent(BROKEN))
    dist = tmp_path / "leaky_driver-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: leaky-driver\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlt_hal]\nleaky = leaky_driver\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    proc = _kit("leaky", env)
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout and "test_a_query_never_sees_later_positions" in proc.stdout
    assert "tailless: 3x203 @ 203x37 exceeds the bound" in proc.stdout
    assert "widthwise: 1 rows x K 64" in proc.stdout
    assert "linear batchwise claims row invariance, but rows in a 13-row call differ" in proc.stdout
    assert "wronggroup (group 32): 1x256 @ 256x96 exceeds the bound" in proc.stdout
    assert "biasless (group None): 1x256 @ 256x96 exceeds the bound" in proc.stdout
    assert "AssertionError: rotary oneround" in proc.stdout
    assert "linear boundwrong: bound form, 1 rows" in proc.stdout
    assert "misbound (deterministic=False) plane 0: bound attention differs" in proc.stdout
    assert "nudged: logits differ from cpu (twice)" in proc.stdout
