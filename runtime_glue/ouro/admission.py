"""``--mode fast``: the fast plan, each fused kernel admitted by a check on the device.

At start-up every fused kernel the driver offers (``Kernel.fast_only``) and every fused
attention backend (``Driver.fused_backends``) is run on this device, at this model's widths,
head counts and block size, on inputs drawn once, and compared with float64. It enters the
plan only within the conformance kit's float64 bounds (``hal.reference``), elementwise:

- ``rms_norm`` and ``add_rms_norm``: ``|out - f64| <= 2^-7 |f64|`` (the kit's norm bound:
  two bf16 roundings); ``add_rms_norm``'s sum within one rounding, ``2^-8 |f64|``.
- ``silu_mul``: ``|out - f64| <= 2^-7 |f64|`` (the kit's bound).
- ``rotary``: ``|out - f64| <= 2^-7 (|x cos| + |rotate_half(x) sin|)`` (three roundings).
- attention: ``|out - f64| <= ATTENTION_BOUND * max|v|`` (the kit's), on a prefill chunk
  after cached context and on decode rows of two requests, through the block table, and
  the rows the backend wrote into the cache read back bit for bit.

Otherwise the plan keeps the exact kernel and says why (``ExecutionPlan.admissions``). A
check is never cached: a new driver, device or model is checked again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from hal.graphs import StaticDecodeMetadata
from hal.interfaces import AttentionBackend, Driver
from hal.kernels import Kernel, KernelUnavailable, rotate_half
from hal.reference import ATTENTION_BOUND, attention_f64
from hal.types import AttentionMetadata, KVLayout
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.kernel_trials import fastest, model_ops
from runtime_glue.ouro.plan import OPS, Admission, ExecutionPlan, exact_rotary

FUSED_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rotary")  # the fast plan's kernel ops
PLAN_ONLY = ("add_rms_norm", "rotary")  # ops only the fused loop calls: ExecutionPlan.fused
ROWS = (1, 5)  # decode and a short prefill
REFUSED = (RuntimeError, ValueError, TypeError, NotImplementedError, KernelUnavailable)


def _rand(*shape, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _verdict(op: str, name: str, got, exact, bound, what: str) -> Admission:
    """Admitted iff every element is within its bound; ``error``: the worst share of it."""
    err = (got.double().cpu() - exact).abs()
    share = float((err / bound.clamp_min(1e-30)).max())
    ok = share <= 1.0
    why = f"within the float64 bound ({what})" if ok else f"exceeds the float64 bound ({what})"
    return Admission(op, name, ok, f"{why}: worst error {share:.3g} of the bound", share, 1.0)


def _norm_f64(x, w, eps):
    x, w = x.double().cpu(), w.double().cpu()
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _worst(verdicts: Iterable[Admission]) -> Admission:
    """The first refusal among ``verdicts`` (the rest are not computed), else the largest error."""
    worst: Admission | None = None
    for v in verdicts:
        if worst is None or not v.admitted or (v.error or 0) > (worst.error or 0):
            worst = v
        if not v.admitted:
            break
    assert worst is not None
    return worst


def _check_kernel(op: str, kernel: Kernel, cfg: OuroConfig, weights, device) -> Admission:
    gen = torch.Generator().manual_seed(17 + FUSED_OPS.index(op))
    gamma = weights["model.layers.0.post_attention_layernorm.weight"]
    return _worst(_kernel_verdicts(op, kernel, cfg, gamma, gen, device))


def _kernel_verdicts(op: str, kernel: Kernel, cfg: OuroConfig, gamma, gen, device):
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    for rows in ROWS:
        if op == "rms_norm":
            x = _rand(rows, H, gen=gen, scale=3.0).to(device)
            exact = _norm_f64(x, gamma, eps)
            v = _verdict(op, kernel.name, kernel.fn(x, gamma, eps), exact, exact.abs() * 2.0**-7,
                         "2^-7 relative")  # fmt: skip
        elif op == "add_rms_norm":
            x, r = _rand(rows, H, gen=gen).to(device), _rand(rows, H, gen=gen, scale=4.0).to(device)
            normed, total = kernel.fn(x, r, gamma, eps)
            s64 = x.double().cpu() + r.double().cpu()
            v = _verdict(op, kernel.name, total, s64, s64.abs() * 2.0**-8, "sum: 2^-8 relative")
            if v.admitted:
                exact = _norm_f64(s64, gamma, eps)
                v = _verdict(op, kernel.name, normed, exact, exact.abs() * 2.0**-7,
                             "2^-7 relative")  # fmt: skip
        elif op == "silu_mul":
            i = cfg.intermediate_size
            both = _rand(rows, 2 * i, gen=gen, scale=4.0).to(device)  # gate|up, as the model
            g, u = both[:, :i].double().cpu(), both[:, i:].double().cpu()
            exact = g * torch.sigmoid(g) * u
            got = kernel.fn(both[:, :i], both[:, i:])
            v = _verdict(op, kernel.name, got, exact, exact.abs() * 2.0**-7, "2^-7 relative")
        else:
            v = _check_rotary(kernel, cfg, rows, gen, device)
        yield v


def _check_rotary(kernel: Kernel, cfg: OuroConfig, rows: int, gen, device) -> Admission:
    d, hq, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qkv = _rand(rows, (hq + 2 * hk) * d, gen=gen, scale=2.0).to(device)  # as the projection
    q, k = qkv[:, : hq * d].view(rows, hq, d), qkv[:, hq * d : (hq + hk) * d].view(rows, hk, d)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
    pos = torch.tensor([0, 7, 1000, 4095, 33][:rows] + [1] * max(0, rows - 5)).float()
    emb = torch.cat((pos[:, None] * inv,) * 2, -1)  # [rows, d], fp32 as the model's table
    cos, sin = emb.cos().bfloat16().to(device), emb.sin().bfloat16().to(device)
    got_q, got_k = kernel.fn(q, k, cos, sin)
    c, s = cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    return _worst(_rotary_verdicts(kernel, ((got_q, q), (got_k, k)), c, s))


def _rotary_verdicts(kernel: Kernel, pairs, c, s):
    for got, x in pairs:
        x = x.double().cpu()
        a, b = x * c, rotate_half(x) * s
        v = _verdict("rotary", kernel.name, got, a + b, (a.abs() + b.abs()) * 2.0**-7,
                     "2^-7 of |x cos| + |rotate_half(x) sin|")  # fmt: skip
        yield v


def check_attention_backend(
    backend: AttentionBackend, driver: Driver, cfg: OuroConfig, block_size: int
) -> Admission:
    """A prefill chunk after cached context beside two decode rows, then decode rows alone
    (in the decode form when the backend has one), over a paged cache: the verdict (refused,
    saying why, where the backend cannot run at these shapes)."""
    trial = functools.partial(_attention_trial, backend, driver, cfg, block_size)
    return _guarded("attention", backend.name, trial)


def _attention_trial(
    backend: AttentionBackend, driver: Driver, cfg: OuroConfig, block_size: int
) -> Admission:
    ctx = block_size + 3  # context crosses a block boundary
    # (query rows, context, blocks): a prefill chunk beside two decode rows (the form for
    # steps with prompt rows), then decode rows alone (the decode form, which step graphs
    # capture: ascend_fia reads a padded context bucket under a mask there)
    cases = (
        [(5, ctx, [6, 1]), (1, 2 * block_size - 1, [3, 0]), (1, 4, [7])],
        [(1, 2 * block_size - 1, [3, 0]), (1, 4, [7]), (1, ctx, [6, 1])],
    )
    gen = torch.Generator().manual_seed(block_size + cfg.head_dim)
    worst = 0.0
    for requests in cases:
        error = _attention_case(backend, driver, cfg, block_size, requests, gen)
        if isinstance(error, Admission):
            return error
        worst = max(worst, error)
    ok = worst <= 1.0
    verdict = "within" if ok else "exceeds"
    why = (
        f"{verdict} the float64 bound ({ATTENTION_BOUND} max|v|) on a prefill chunk with decode "
        f"rows and on decode rows alone at block size {block_size}: worst error {worst:.3g} of "
        "the bound"
    )
    return Admission("attention", backend.name, ok, why, worst, 1.0)


def _attention_case(backend, driver, cfg, block_size: int, requests, gen) -> float | Admission:
    """One step of ``requests`` over a fresh paged cache: the worst error as a share of the
    bound, or a refusal when the rows the backend wrote read back different."""
    device = driver.device.torch_device
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layout = KVLayout(1, 8, block_size, kv_heads, d)
    kv = driver.create_kv_store(layout)
    scaling = d**-0.5
    history = {}
    for i, (_, c, blocks) in enumerate(requests):  # the cached context, written exactly
        k, v = _rand(c, kv_heads, d, gen=gen, scale=2.0), _rand(c, kv_heads, d, gen=gen)
        meta = AttentionMetadata.build(block_size, [(c, 0, blocks)], layout.num_slots)
        kv.write(0, k.to(device), v.to(device), meta.to(device)[0].slot_mapping)
        history[i] = (k, v)
    total = sum(n for n, _, _ in requests)
    q = _rand(1, heads, total, d, gen=gen, scale=2.0).to(device)
    new_k = _rand(total, kv_heads, d, gen=gen, scale=2.0).to(device)
    new_v = _rand(total, kv_heads, d, gen=gen).to(device)
    meta = AttentionMetadata.build(block_size, requests, layout.num_slots).to(device)[0]
    backend.write_kv(kv, 0, new_k, new_v, meta)
    back_k, back_v = kv.gather(0, meta.slot_mapping)
    if not (
        torch.equal(back_k[0].transpose(0, 1), new_k)
        and torch.equal(back_v[0].transpose(0, 1), new_v)
    ):
        why = "the rows it wrote into the paged cache read back different"
        return Admission("attention", backend.name, False, why)
    step: AttentionMetadata | StaticDecodeMetadata = meta
    if meta.num_tokens == meta.num_requests and backend.step_graphs:  # the fast decode form
        step = StaticDecodeMetadata.bucketed(meta)
    out = backend.forward(q, 0, kv, step, scaling).double().cpu()
    worst = 0.0
    for r, (n, c, _) in enumerate(requests):
        start = meta.host_query_start_loc[r]
        k = torch.cat((history[r][0], new_k[start : start + n].cpu()))[None].transpose(1, 2)
        v = torch.cat((history[r][1], new_v[start : start + n].cpu()))[None].transpose(1, 2)
        exact = attention_f64(q[:, :, start : start + n].cpu(), k, v, scaling, c)
        err = (out[start : start + n] - exact).abs().max() / (ATTENTION_BOUND * v.abs().max())
        worst = max(worst, float(err))
    return worst


def _guarded(op: str, name: str, check: Callable[[], Admission]) -> Admission:
    try:
        return check()
    except REFUSED as exc:  # cannot run at these shapes here: refused, and why
        return Admission(op, name, False, f"cannot run here: {type(exc).__name__}: {exc}")


def nothing_to_admit(driver: Driver, registry) -> str:
    """What a fast plan on a driver without fused kernels lacks, and which drivers are missing
    here and why (on a host without CANN: what to source), as ``--device npu`` says it."""
    missing = [f"{spec.name} ({p.reason})" for spec, p in registry.probe_all() if not p.available]
    where = f"; unavailable here: {'; '.join(missing)}" if missing else ""
    return (
        f"fast mode: {driver.label} offers no fused kernels, so its fastest unfused ones run{where}"
    )


def fast_plan(
    driver: Driver,
    cfg: OuroConfig,
    weights: dict[str, torch.Tensor],
    attention: str | None,
    linear: str | None,
    block_size: int,
    activations: str | None = None,
) -> ExecutionPlan:
    """The fast plan: stacked projections, each fused kernel that passes its check, and for
    every other op the fastest kernel timed now (``kernel_trials.fastest``), from a choice
    that includes every kernel a deterministic plan may take."""
    device = driver.device.torch_device
    admissions: list[Admission] = []
    chosen: dict[str, str] = {}
    for op in FUSED_OPS:
        chosen[op] = "torch"
        for kernel in (k for k in driver.kernels_for(op) if k.fast_only):
            check = functools.partial(_check_kernel, op, kernel, cfg, weights, device)
            verdict = _guarded(op, kernel.name, check)
            admissions.append(verdict)
            if verdict.admitted and chosen[op] == "torch":
                chosen[op] = kernel.name
    if chosen["rotary"] == "torch":  # none admitted: one with the composition's bits, if any
        chosen["rotary"] = exact_rotary(driver) or "torch"
    backend_name = attention or driver.default_backend
    candidates = [attention] if attention in driver.fused_backends else []
    if attention is None:
        candidates = list(driver.fused_backends)
    for name in candidates:
        backend = driver.fused_backends[name]
        verdict = check_attention_backend(backend, driver, cfg, block_size)
        admissions.append(verdict)
        if verdict.admitted:
            backend_name = name
            break
        if attention is not None:
            backend_name = driver.default_backend
    fixed = {op: k for op, k in chosen.items() if op in OPS and k != "torch"}
    ops = model_ops(cfg, weights, device)
    picked, measured = fastest(driver, ops, linear, fixed, activations)
    taken = [a for a in admissions if a.admitted]
    notes = (
        f"fast mode: {len(taken)} of {len(admissions)} fused kernels admitted on "
        f"{driver.label} at this model's shapes; the other ops' kernels the fastest timed "
        "now; q|k|v and gate|up stacked",
    )
    return ExecutionPlan(
        "fast",
        backend_name,
        stacked=True,
        prompt=tuple(picked["prompt"].items()),
        generated=tuple(picked["generated"].items()),
        measurements=measured,
        notes=notes,
        fused=tuple((op, chosen[op]) for op in PLAN_ONLY),
        admissions=tuple(admissions),
    )
