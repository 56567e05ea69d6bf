"""Conformance checks for one driver (selected with --rlt-driver): addressing past a plane,
and decode KV sharing's reads and writes through such tables (``hal.shared_kv``)."""

from __future__ import annotations

import torch

from hal.reference import ATTENTION_BOUND, attention_f64, rand_bf16
from hal.testing.test_conformance import HEADS, _modes
from hal.types import KVLayout

SHARED_LAYOUT = KVLayout(num_planes=4, num_blocks=6, block_size=16, num_kv_heads=2, head_dim=32)
SHARED_LOOPS, SHARED_LAYERS = 2, 2
# (query_len, context_len, prompt blocks, prompt length, generated blocks): a decode row whose
# generated blocks lie in loop planes 1 and 0; a chunk of generated rows; a prompt chunk; a
# generated row in the prompt's last block, which keeps every loop's K/V as prompt rows do.
SHARED_REQUESTS = [
    (1, 40, [0], 10, [7, 3]),
    (3, 17, [2], 9, [11]),
    (5, 0, [4], 16, []),
]


def _shared_store(driver, gen):
    kv = driver.create_kv_store(SHARED_LAYOUT)
    dev = driver.device.torch_device
    slots = torch.arange(SHARED_LAYOUT.num_slots, device=dev)
    for p in range(SHARED_LAYOUT.num_planes):
        k = rand_bf16(SHARED_LAYOUT.num_slots, 2, 32, gen=gen, scale=2.0).to(dev)
        kv.write(p, k, rand_bf16(SHARED_LAYOUT.num_slots, 2, 32, gen=gen).to(dev), slots)
    return kv


def _where(t: int, layer: int, request, p: int) -> tuple[int, int]:
    """(plane, slot) of position ``p`` at loop ``t`` and ``layer``, by the sharing rule: a
    prompt block keeps loop ``t``'s plane, a generated block ``g`` loop plane
    ``g // num_blocks`` whatever the loop."""
    _, _, prompt, prompt_len, generated = request
    bs, nb = SHARED_LAYOUT.block_size, SHARED_LAYOUT.num_blocks
    i, offset = divmod(p, bs)
    m = -(-prompt_len // bs)
    if i < m:
        return t * SHARED_LAYERS + layer, prompt[i] * bs + offset
    j, b = divmod(generated[i - m], nb)
    return j * SHARED_LAYERS + layer, b * bs + offset


def _shared_kv_by_hand(kv, t, layer, request, dev):
    """A request's K/V at loop ``t`` and ``layer``, read one position at a time."""
    q_len, ctx = request[0], request[1]
    parts = []
    for p in range(ctx + q_len):
        plane, slot = _where(t, layer, request, p)
        parts.append(kv.gather(plane, torch.tensor([slot], device=dev)))
    return torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)


def _shared_addressing(dev):
    from hal.shared_kv import build_shared_addressing

    kv = build_shared_addressing(
        16, SHARED_REQUESTS, SHARED_LAYOUT.num_blocks, SHARED_LAYERS, SHARED_LOOPS
    )
    return kv.to(dev)[0]


def test_slots_past_a_plane_address_the_planes_after_it(driver):
    gen = torch.Generator().manual_seed(5)
    kv = driver.create_kv_store(SHARED_LAYOUT)
    dev = driver.device.torch_device
    S = SHARED_LAYOUT.num_slots
    planes, slots = [1, 3, 1, 2], [15, 16, 95, 40]
    for base in (0, 1):  # rows of planes 1..3, addressed from plane 0 and from plane 1
        k, v = rand_bf16(4, 2, 32, gen=gen).to(dev), rand_bf16(4, 2, 32, gen=gen).to(dev)
        far = [(p - base) * S + s for p, s in zip(planes, slots, strict=True)]
        kv.write(base, k, v, torch.tensor(far, device=dev))
        got_k, got_v = kv.gather(base, torch.tensor(far, device=dev))
        assert got_k.shape == (1, 2, 4, 32) and got_k.is_contiguous()
        assert torch.equal(got_k[0].transpose(0, 1).cpu(), k.cpu())
        assert torch.equal(got_v[0].transpose(0, 1).cpu(), v.cpu())
        for i, (p, s) in enumerate(zip(planes, slots, strict=True)):
            one_k, _ = kv.gather(p, torch.tensor([s], device=dev))
            assert torch.equal(one_k[0, :, 0].cpu(), k[i].cpu()), f"slot {i} is not plane {p}"


def test_attention_under_kv_sharing_reads_prompt_blocks_and_shared_blocks(driver):
    gen = torch.Generator().manual_seed(6)
    kv = _shared_store(driver, gen)
    dev = driver.device.torch_device
    addressing = _shared_addressing(dev)
    meta0 = addressing.base
    q = rand_bf16(1, HEADS, meta0.num_tokens, 32, gen=gen, scale=2.0).to(dev)
    for backend, deterministic in _modes(driver):
        for t in range(SHARED_LOOPS):
            for layer in range(SHARED_LAYERS):
                plane, meta = addressing.plane(t, layer), addressing.meta(t)
                out = backend.forward(q, plane, kv, meta, 32**-0.5, deterministic)
                out = out.double().cpu()
                for r, request in enumerate(SHARED_REQUESTS):
                    start, n, ctx = meta.request(r)
                    k, v = _shared_kv_by_hand(kv, t, layer, request, dev)
                    ref = attention_f64(
                        q[:, :, start : start + n].cpu(), k.cpu(), v.cpu(), 32**-0.5, ctx
                    )
                    err = (out[start : start + n] - ref).abs().max()
                    bound = ATTENTION_BOUND * float(v.abs().max())
                    what = f"{backend.name} ({deterministic=}) loop {t} layer {layer} request {r}"
                    assert err <= bound, f"{what}: {err:.4g} > {bound:.4g}"


def test_kv_sharing_writes_land_in_the_loop_plane_or_the_shared_block(driver):
    gen = torch.Generator().manual_seed(7)
    kv = driver.create_kv_store(SHARED_LAYOUT)
    dev = driver.device.torch_device
    addressing = _shared_addressing(dev)
    backend = driver.backend(None)
    for t in range(SHARED_LOOPS):
        for layer in range(SHARED_LAYERS):
            meta = addressing.meta(t)
            k = rand_bf16(meta.num_tokens, 2, 32, gen=gen).to(dev)
            backend.write_kv(kv, addressing.plane(t, layer), k, k, meta)
            for r, request in enumerate(SHARED_REQUESTS):
                start, n, ctx = meta.request(r)
                got, _ = _shared_kv_by_hand(kv, t, layer, request, dev)
                want = k[start : start + n].cpu()
                assert torch.equal(got[0, :, ctx:].transpose(0, 1).cpu(), want)
