"""Conformance checks for one driver (selected with --rlt-driver): registration, the device
and its fences, KV planes, attention backends, and end-to-end greedy parity with the cpu
driver. Its kernels' checks: ``test_kernels``; kv sharing's addressing: ``test_shared_kv``."""

from __future__ import annotations

import functools
import importlib.metadata
import warnings

import pytest
import torch

from hal.eager import paged_eager_attention
from hal.graphs import StaticDecodeMetadata
from hal.interfaces import AttentionBackend, Device, Driver, Fence, KVStore
from hal.reference import ATTENTION_BOUND, attention_f64, rand_bf16
from hal.registry import Registry
from hal.spec import ProbeResult
from hal.types import AttentionMetadata, KVLayout

LAYOUT = KVLayout(num_planes=3, num_blocks=6, block_size=16, num_kv_heads=2, head_dim=32)
HEADS = 4


def _meta(requests, device):
    """requests: (query_len, context_len, block ids) -> one step's metadata on ``device``.

    Every backend is checked through ``AttentionMetadata``'s flat fields only (block tables,
    lengths, query start offsets, slot mapping), the inputs a fused paged kernel takes."""
    return AttentionMetadata.build(LAYOUT.block_size, requests, LAYOUT.num_slots).to(device)[0]


def _modes(driver):
    """(backend, deterministic) for every backend, in each mode it supports."""
    for backend in _backends(driver):
        yield backend, False
        if backend.supports_deterministic:
            yield backend, True


def _filled_store(driver, gen):
    kv = driver.create_kv_store(LAYOUT)
    dev = driver.device.torch_device
    slots = torch.arange(LAYOUT.num_slots, device=dev)
    for p in range(LAYOUT.num_planes):
        k = rand_bf16(LAYOUT.num_slots, 2, 32, gen=gen, scale=2.0).to(dev)
        kv.write(p, k, rand_bf16(LAYOUT.num_slots, 2, 32, gen=gen).to(dev), slots)
    return kv


# -- registration and interfaces ---------------------------------------------------------


def test_the_driver_is_discovered_through_the_rlt_hal_entry_point_group(rlt_driver_name):
    groups = importlib.metadata.entry_points(group="rlt_hal")
    assert groups, "no package declares an rlt_hal entry point"
    assert rlt_driver_name in Registry().names


def test_the_probe_returns_a_probe_result_saying_available(rlt_driver_name):
    probe = Registry().spec(rlt_driver_name).probe()
    assert isinstance(probe, ProbeResult) and probe.available, probe.reason


def test_create_returns_a_driver_with_a_device_and_named_backends(driver):
    assert isinstance(driver, Driver) and isinstance(driver.device, Device)
    assert driver.default_backend in driver.backends
    for name, backend in driver.backends.items():
        assert isinstance(backend, AttentionBackend) and backend.name == name
    driver.device.initialize()  # idempotent
    assert isinstance(driver.device.torch_device, torch.device)
    assert isinstance(driver.create_kv_store(LAYOUT), KVStore)


def test_fences_complete_once_waited_and_stay_complete(driver):
    fence = driver.device.record_fence()
    assert isinstance(fence, Fence)
    fence.wait()
    assert fence.done() and fence.done()
    driver.device.synchronize()


# -- the KV store --------------------------------------------------------------------------


def test_kv_rows_read_back_from_their_plane_across_page_boundaries(driver):
    gen = torch.Generator().manual_seed(0)
    kv = driver.create_kv_store(LAYOUT)
    dev = driver.device.torch_device
    slots = torch.tensor([15, 16, 17, 47, 48, 95], device=dev)  # pages 0|1, 2|3 and the last
    k, v = rand_bf16(6, 2, 32, gen=gen).to(dev), rand_bf16(6, 2, 32, gen=gen).to(dev)
    kv.write(1, k, v, slots)
    got_k, got_v = kv.gather(1, slots)
    assert got_k.shape == (1, 2, 6, 32) and got_k.is_contiguous()
    assert torch.equal(got_k[0].transpose(0, 1).cpu(), k.cpu())
    assert torch.equal(got_v[0].transpose(0, 1).cpu(), v.cpu())
    for other in (0, 2):
        ok, ov = kv.gather(other, slots)
        assert not ok.any() and not ov.any(), f"a write to plane 1 reached plane {other}"


# -- attention -----------------------------------------------------------------------------


def _backends(driver):
    return list(driver.backends.values())


def test_attention_is_within_the_stated_bound_of_float64(driver):
    gen = torch.Generator().manual_seed(1)
    kv = _filled_store(driver, gen)
    dev = driver.device.torch_device
    q = rand_bf16(1, HEADS, 6, 32, gen=gen, scale=2.0).to(dev)
    meta = _meta([(5, 11, [0]), (1, 30, [5, 2])], dev)  # the second in pages 5, then 2
    for backend, deterministic in _modes(driver):
        for plane in range(LAYOUT.num_planes):
            out = backend.forward(q, plane, kv, meta, 32**-0.5, deterministic).double().cpu()
            for r in range(meta.num_requests):
                start, n, ctx = meta.request(r)
                k, v = kv.gather(plane, meta.request_slots(r))
                qs = q[:, :, start : start + n]
                ref = attention_f64(qs.cpu(), k.cpu(), v.cpu(), 32**-0.5, ctx)
                err = (out[start : start + n] - ref).abs().max()
                bound = ATTENTION_BOUND * float(v.abs().max())
                what = f"{backend.name} (deterministic={deterministic}) plane {plane}"
                assert err <= bound, f"{what}: {err:.4g} > {bound:.4g}"


def test_a_backends_decode_form_reads_each_rows_own_context_within_the_bound(driver):
    """A backend that claims ``step_graphs`` takes a decode-only step in its static form
    (``hal.graphs.StaticDecodeMetadata``: each row's context bucket, spare table entries
    repeating its first block, a mask past its length). Each row must stay within the bound
    of float64 over exactly its own context (the padded positions hold other rows' finite K/V,
    which a backend that ignored the mask would read); in deterministic mode it must give the
    eager form's bits (padding-invariant by contract)."""
    gen = torch.Generator().manual_seed(7)
    kv = _filled_store(driver, gen)
    dev = driver.device.torch_device
    q = rand_bf16(1, HEADS, 3, 32, gen=gen, scale=2.0).to(dev)
    meta = _meta([(1, 11, [0]), (1, 30, [5, 2]), (1, 3, [4])], dev)
    static = StaticDecodeMetadata.bucketed(meta)
    assert static.context == 2 * LAYOUT.block_size  # a bucket wider than two rows' context
    graphed = [b for b in (*_backends(driver), *driver.fused_backends.values()) if b.step_graphs]
    for backend in graphed:
        for deterministic in (False, True) if backend.supports_deterministic else (False,):
            out = backend.forward(q, 1, kv, static, 32**-0.5, deterministic)
            what = f"{backend.name} (deterministic={deterministic}) decode form"
            for r in range(meta.num_requests):
                _, _, ctx = meta.request(r)
                k, v = kv.gather(1, meta.request_slots(r))
                ref = attention_f64(q[:, :, r : r + 1].cpu(), k.cpu(), v.cpu(), 32**-0.5, ctx)
                err = (out[r : r + 1].double().cpu() - ref).abs().max()
                bound = ATTENTION_BOUND * float(v.abs().max())
                assert err <= bound, f"{what}, row {r}: {err:.4g} > {bound:.4g}"
            if deterministic:
                eager = backend.forward(q, 1, kv, meta, 32**-0.5, True)
                assert torch.equal(out.cpu(), eager.cpu()), f"{what}: not the eager form's bits"


def test_hf_exact_backends_equal_the_shared_hf_order_bit_for_bit(driver):
    exact = [b for b in _backends(driver) if b.hf_exact]
    if not exact:
        pytest.skip("this driver declares no HF-exact backend")
    gen = torch.Generator().manual_seed(2)
    kv = _filled_store(driver, gen)
    dev = driver.device.torch_device
    meta = _meta([(7, 9, [0]), (1, 20, [3, 4])], dev)
    q = rand_bf16(1, HEADS, 8, 32, gen=gen, scale=2.0).to(dev)
    want = paged_eager_attention(q, 1, kv, meta, 32**-0.5)
    for backend in exact:
        assert torch.equal(backend.forward(q, 1, kv, meta, 32**-0.5), want), backend.name


def test_attention_reads_only_its_plane_and_its_own_requests_slots(driver):
    gen = torch.Generator().manual_seed(3)
    kv = _filled_store(driver, gen)
    dev = driver.device.torch_device
    q = rand_bf16(1, HEADS, 5, 32, gen=gen).to(dev)
    meta = _meta([(3, 5, [0]), (2, 10, [2])], dev)  # slots 0..7 and 32..43
    for backend, deterministic in _modes(driver):
        clean = backend.forward(q, 1, kv, meta, 32**-0.5, deterministic)
        used = torch.zeros(LAYOUT.num_slots, dtype=torch.bool)
        used[list(range(8)) + list(range(32, 44))] = True
        saved = kv.gather(1, torch.arange(LAYOUT.num_slots, device=dev))
        poison = torch.full((LAYOUT.num_slots, 2, 32), float("nan")).bfloat16().to(dev)
        for plane in (0, 2):
            kv.write(plane, poison, poison, torch.arange(LAYOUT.num_slots, device=dev))
        unused = torch.nonzero(~used)[:, 0].to(dev)
        kv.write(1, poison[: len(unused)], poison[: len(unused)], unused)
        assert torch.equal(backend.forward(q, 1, kv, meta, 32**-0.5, deterministic), clean), (
            backend.name
        )
        kv.write(
            1,
            saved[0][0].transpose(0, 1),
            saved[1][0].transpose(0, 1),
            torch.arange(LAYOUT.num_slots, device=dev),
        )


def test_a_backends_bound_form_writes_and_attends_as_write_kv_and_forward(driver):
    """``AttentionBackend.bind`` (what a bound decode loop calls once a loop): its writes land
    where ``write_kv``'s do and its attention gives ``forward``'s bits, on every plane, in
    each mode, with decode rows (heads contiguous views of a q|k|v row, as a model's loop
    makes them) and a request whose blocks are out of order. Every backend is checked: the
    message names each that fails."""
    bad = [why for backend, det in _modes(driver) if (why := _bound_differs(driver, backend, det))]
    assert not bad, "; ".join(bad)


def _bound_differs(driver, backend, deterministic) -> str | None:
    gen, dev = torch.Generator().manual_seed(4), driver.device.torch_device
    meta = _meta([(1, 11, [0]), (1, 30, [5, 2]), (1, 3, [3])], dev)
    n, what = meta.num_tokens, f"{backend.name} (deterministic={deterministic})"
    want = _filled_store(driver, torch.Generator().manual_seed(5))
    got = _filled_store(driver, torch.Generator().manual_seed(5))
    try:
        bound = backend.bind(got, meta, 32**-0.5, deterministic)
        for plane in range(LAYOUT.num_planes):
            qkv = rand_bf16(n, (HEADS + 4) * 32, gen=gen).to(dev)
            k = qkv[:, HEADS * 32 : (HEADS + 2) * 32].view(n, 2, 32)
            v = qkv[:, (HEADS + 2) * 32 :].view(n, 2, 32)
            q = qkv[:, : HEADS * 32].view(n, HEADS, 32).transpose(0, 1)[None]
            backend.write_kv(want, plane, k, v, meta)
            bound.write(plane, k, v)
            out = torch.full((n, HEADS * 32), 7.0, dtype=torch.bfloat16, device=dev)
            bound.attend(q, plane, out)
            if not torch.equal(out, backend.forward(q, plane, want, meta, 32**-0.5, deterministic)):
                return f"{what} plane {plane}: bound attention differs from forward"
    except Exception as exc:  # a backend that cannot run the check fails it, named
        return f"{what}: {type(exc).__name__}: {exc}"
    every = torch.arange(LAYOUT.num_slots, device=dev)
    for plane in range(LAYOUT.num_planes):
        for a, b in zip(want.gather(plane, every), got.gather(plane, every), strict=True):
            if not torch.equal(a, b):
                return f"{what}: bound writes differ from write_kv's on plane {plane}"
    return None


def test_a_query_never_sees_later_positions(driver):
    gen = torch.Generator().manual_seed(4)
    kv = _filled_store(driver, gen)
    dev = driver.device.torch_device
    q = rand_bf16(1, HEADS, 8, 32, gen=gen).to(dev)
    meta = _meta([(8, 12, [0, 1])], dev)  # positions 12..19, slots 12..19
    for backend, deterministic in _modes(driver):
        before = backend.forward(q, 0, kv, meta, 32**-0.5, deterministic)
        later = torch.tensor([16, 17, 18, 19], device=dev)
        junk = rand_bf16(4, 2, 32, gen=gen, scale=5.0).to(dev)
        kv.write(0, junk, junk, later)
        after = backend.forward(q, 0, kv, meta, 32**-0.5, deterministic)
        assert torch.equal(after[:4], before[:4]), f"{backend.name} leaked future positions"
        assert not torch.equal(after[4:], before[4:])


def test_copy_moves_rows_to_other_slots_in_every_plane(driver):
    """``KVStore.copy`` (n > 1: a forked request's partial page): every plane's rows at the
    source slots appear at the destination slots; nothing else changes."""
    gen = torch.Generator().manual_seed(8)
    kv = _filled_store(driver, gen)
    dev = driver.device.torch_device
    src, dst = torch.tensor([3, 4, 5], device=dev), torch.tensor([40, 41, 42], device=dev)
    planes = range(kv.layout.num_planes)
    before = [kv.gather(p, torch.arange(kv.layout.num_slots, device=dev)) for p in planes]
    kv.copy(src, dst)
    for p in planes:
        k, v = kv.gather(p, torch.arange(kv.layout.num_slots, device=dev))
        want_k, want_v = before[p][0].clone(), before[p][1].clone()
        want_k[:, :, dst.cpu()] = before[p][0][:, :, src.cpu()]
        want_v[:, :, dst.cpu()] = before[p][1][:, :, src.cpu()]
        assert torch.equal(k.cpu(), want_k.cpu()) and torch.equal(v.cpu(), want_v.cpu()), p


# -- end to end ----------------------------------------------------------------------------


def test_greedy_generation_matches_the_cpu_driver(driver, rlt_driver_name, tmp_path_factory):
    # The kit's end-to-end case drives the runtime; hal's library code never imports it.
    from runtime_glue.engine.sampling import SamplingParams
    from runtime_glue.ouro.toy import preset_config, write_checkpoint

    ckpt = write_checkpoint(tmp_path_factory.mktemp("kit"), preset_config("tiny"), seed=5)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 9, 200, 17, 3, 44, 61], list(range(10, 30))]
    # Both sides in the HF-exact mode: the kit compares the driver's arithmetic, not modes.
    want = _exact_generation(ckpt, "cpu", None, prompts, params)
    for backend in driver.backends:
        exact = driver.device.torch_device.type == "cpu" and driver.backends[backend].hf_exact
        generate = functools.partial(
            _exact_generation, ckpt, rlt_driver_name, backend, prompts, params
        )  # a fresh engine each call
        got = generate()
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids, f"{backend}: greedy tokens differ from cpu"
        if exact and not _same_logits(got, want):
            # HF-exact bits are torch's bf16 kernels' bits, and those do not always repeat
            # within a process: after the kit's earlier cases, the first HF-exact engine of
            # this case sometimes computes a prompt's prefill in other bits than every engine
            # after it (seen on a CI machine and on an AVX-512 Xeon, about 1 kit run in 7;
            # never with this case alone; the cause is not found). A driver's own error
            # repeats; that does not: a mismatch fails only if fresh engines on both sides
            # repeat it.
            again = generate()
            reference = _exact_generation(ckpt, "cpu", None, prompts, params)
            assert _same_logits(again, reference), f"{backend}: logits differ from cpu (twice)"
            warnings.warn(
                f"{backend}: one pair of runs' logits differed and a fresh pair's did not: "
                "torch's bf16 kernels did not repeat their bits in this process",
                stacklevel=1,
            )


def _exact_generation(ckpt, device: str, backend: str | None, prompts, params):
    from runtime_glue.engine.llm import LLM

    engine = LLM(
        ckpt,
        device=device,
        attention_backend=backend,
        block_size=16,
        num_blocks=16,
        deterministic=False,
    )
    return engine.generate(prompts, params, return_logits=True)


def _same_logits(got, want) -> bool:
    for g, w in zip(got, want, strict=True):
        assert g.logits is not None and w.logits is not None
        if not torch.equal(g.logits, w.logits):
            return False
    return True
