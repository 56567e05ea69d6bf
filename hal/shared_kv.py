"""Decode KV sharing (``--kv-sharing last``): the two regions of a request's keys and values.

The Ouro paper's last-step reuse (section 5.4.2, table 14): prompt positions keep their
T * L planes; a generated position keeps one shared plane per layer, which every loop writes
in turn and reads, so it ends holding the last loop's K/V (under adaptive depth, the exit
loop's). At plane ``(t, l)`` a request's query therefore sees its prompt positions' plane-(t, l)
K/V followed by its generated positions' shared-plane-``l`` K/V, its own row among them as
loop ``t`` just wrote it.

Geometry: no memory is added. The store keeps its ``T * L`` planes of ``S`` slots; the shared
plane of layer ``l`` is the union of the ``T`` loop planes of that layer, ``T * S`` "shared
slots" where shared block ``g`` (of ``T * num_blocks``) lies in loop plane ``g // num_blocks``
at physical block ``g % num_blocks``. A physical block therefore holds one prompt block, or up
to ``T`` generated blocks (``runtime_glue.engine.shared_blocks`` hands them out), and every
K/V row has one address in the whole store, ``plane * S + slot``:

    prompt position, slot s, plane (t, l):   s + l * S + t * L * S
    generated position, shared slot s':      (s' // S) * L * S + s' % S + l * S    (any t)

so an address is ``base + l * S + t * L * S * is_prompt``, two vector ops per plane from
values built once per step on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hal.interfaces import KVStore
from hal.types import AttentionMetadata, SharedRegion, SharedRequest, check_slot_mapping

KV_SHARING = ("none", "last")


def check_kv_sharing(value: str) -> str:
    if value not in KV_SHARING:
        raise ValueError(f"kv_sharing must be one of {', '.join(KV_SHARING)}; got {value!r}")
    return value


def shared_address(shared_slot: int, layer: int, layers: int, num_slots: int) -> int:
    """The store address of generated shared slot ``shared_slot`` at layer ``layer``."""
    j, s = divmod(shared_slot, num_slots)
    return j * layers * num_slots + s + layer * num_slots


def _position(p: int, prompt_len: int, prompt_blocks, gen_blocks, bs: int, S: int, L: int):
    """``(slot, base address, is_prompt)`` of position ``p`` of one request."""
    if p < prompt_len:
        slot = prompt_blocks[p // bs] * bs + p % bs
        return slot, slot, 1
    g = p - prompt_len
    slot = gen_blocks[g // bs] * bs + g % bs
    return slot, shared_address(slot, 0, L, S), 0


def _slots(blocks: Sequence[int], n: int, bs: int) -> torch.Tensor:
    """The slots of a block table's first ``n`` positions."""
    if n > len(blocks) * bs:
        raise IndexError(f"{n} positions do not fit in {len(blocks)} blocks of {bs}")
    table = torch.tensor(list(blocks), dtype=torch.int64)
    return (table[:, None] * bs + torch.arange(bs)).flatten()[:n]


def _request_kv(request: SharedRequest, bs: int, S: int, L: int):
    """Base addresses and prompt flags of positions ``0 .. seq_len - 1`` of one request."""
    query_len, ctx, prompt_blocks, prompt_len, gen_blocks = request
    seq = ctx + query_len
    prompt = _slots(prompt_blocks, min(seq, prompt_len), bs)
    shared = _slots(gen_blocks, max(0, seq - prompt_len), bs)
    base = torch.cat((prompt, (shared // S) * (L * S) + shared % S))
    flags = torch.cat((torch.ones_like(prompt), torch.zeros_like(shared)))
    return base, flags


def build_shared_metadata(
    block_size: int,
    requests: Sequence[SharedRequest],
    num_slots: int,
    layers: int,
    loops: int,
) -> AttentionMetadata:
    """Host metadata for ``requests`` under decode KV sharing: ``(query_len, context_len,
    prompt block ids, prompt length, generated block ids)`` each, rows in that order.

    ``block_tables`` are the prompt blocks; ``slot_mapping`` holds a prompt row's plane slot
    and a generated row's shared slot. Checked here, on the host: slots in range, no slot
    written twice, and no physical block both a prompt block and a generated block's home."""
    slots: list[int] = []
    row_base: list[int] = []
    row_prompt: list[int] = []
    kv_base: list[torch.Tensor] = []
    kv_prompt: list[torch.Tensor] = []
    kv_start, starts, table = [0], [0], []
    width = max((len(r[2]) for r in requests), default=0)
    bs, S, L = block_size, num_slots, layers
    prompt_slots: list[int] = []
    gen_slots: list[int] = []
    for request in requests:
        query_len, ctx, prompt_blocks, prompt_len, gen_blocks = request
        for p in range(ctx, ctx + query_len):  # the step's new rows
            slot, base, is_prompt = _position(p, prompt_len, prompt_blocks, gen_blocks, bs, S, L)
            slots.append(slot)
            row_base.append(base)
            row_prompt.append(is_prompt)
            (prompt_slots if is_prompt else gen_slots).append(slot)
        base_t, flags_t = _request_kv(request, bs, S, L)  # every position it reads
        kv_base.append(base_t)
        kv_prompt.append(flags_t)
        kv_start.append(kv_start[-1] + ctx + query_len)
        starts.append(starts[-1] + query_len)
        table.append(list(prompt_blocks) + [0] * (width - len(prompt_blocks)))
    check_slot_mapping(prompt_slots, num_slots)
    check_slot_mapping(gen_slots, loops * num_slots)
    homes = {(s % num_slots) // bs for s in gen_slots}
    clash = homes & {s // bs for s in prompt_slots}
    if clash:
        raise IndexError(f"blocks {sorted(clash)} hold both prompt and generated positions")
    ctx_lens = [r[1] for r in requests]
    region = SharedRegion(
        layers,
        loops,
        num_slots,
        tuple((q, c, tuple(pb), n, tuple(gb)) for q, c, pb, n, gb in requests),
        tuple(kv_start),
        torch.tensor(row_base, dtype=torch.int64),
        torch.tensor(row_prompt, dtype=torch.int64),
        torch.cat(kv_base) if kv_base else torch.zeros(0, dtype=torch.int64),
        torch.cat(kv_prompt) if kv_prompt else torch.zeros(0, dtype=torch.int64),
    )
    return AttentionMetadata(
        block_size,
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(table, dtype=torch.int32).view(len(requests), width),
        torch.tensor([q + c for q, c, *_ in requests], dtype=torch.int32),
        torch.tensor(ctx_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        tuple(starts),
        tuple(ctx_lens),
        shared=region,
    )


def select_metadata(meta: AttentionMetadata, requests: Sequence[int]) -> AttentionMetadata:
    """:meth:`AttentionMetadata.select`, also under sharing (rebuilt from the host copy)."""
    region = meta.shared
    if region is None:
        return meta.select(requests)
    chosen = build_shared_metadata(
        meta.block_size,
        [region.requests[r] for r in requests],
        region.num_slots,
        region.layers,
        region.loops,
    )
    return chosen.to(meta.block_tables.device)[0]


# -- the two operations the model and the backends call -----------------------------------


def write_kv(kv: KVStore, plane: int, key, value, meta: AttentionMetadata) -> None:
    """Store a step's new K/V rows of ``plane``: into the plane, or, under sharing, each
    generated row into its layer's shared plane."""
    if meta.shared is None:
        kv.write(plane, key, value, meta.slot_mapping)
    else:
        kv.write_at(meta.shared.write_addresses(plane), key, value)


def request_kv(kv: KVStore, plane: int, meta: AttentionMetadata, r: int):
    """Request ``r``'s keys and values at ``plane``, ``[1, kv_heads, seq_len, d]`` each."""
    if meta.shared is None:
        return kv.gather(plane, meta.request_slots(r))
    return kv.gather_at(meta.shared.request_addresses(plane, r))
