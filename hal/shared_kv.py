"""Decode KV sharing (``--kv-sharing last``) as an addressing scheme: per-loop block tables.

The Ouro paper's last-step reuse (section 5.4.2, table 14): prompt positions keep their
T * L planes; a generated position keeps one shared plane per layer, which every loop writes
in turn and reads, so it ends holding the last loop's K/V (under adaptive depth, the exit
loop's). At plane ``(t, l)`` a request's query therefore sees its prompt positions' plane-(t, l)
K/V followed by its generated positions' shared K/V, its own row among them as loop ``t`` just
wrote it.

Sharing is paged in whole blocks. A request's logical block ``i`` is a *prompt block* for
``i < ceil(prompt_len / block_size)`` (every plane, as without sharing: the prompt's last block,
when partial, also keeps the first generated positions that fall in it, in every plane, since
the block holds every plane anyway) and a *generated block* after that (one shared plane per
layer). Geometry, no memory added: generated block ``g`` (of ``T * num_blocks``) lies in loop
plane ``j = g // num_blocks`` of physical block ``b = g % num_blocks``, so a physical block
holds one prompt block or ``T`` generated blocks (``runtime_glue.engine.shared_blocks``).

Every loop of layer ``l`` is then addressed from plane ``l``, the layer's first
(``hal.types.KVAddressing``), with loop ``t``'s block table:

    prompt block p:     p + t * L * num_blocks          (plane t * L + l)
    generated block g:  j * L * num_blocks + b          (plane j * L + l, whatever t)

ordinary block ids that reach later planes of the store (``hal.types.AttentionMetadata``).
Backends, fused KV writes and captured graphs read and write through them without knowing
about sharing.
"""

from __future__ import annotations

from collections.abc import Sequence

from hal.types import AttentionMetadata, KVAddressing

KV_SHARING = ("none", "last")

# (query_len, context_len, prompt block ids, prompt length, generated block ids)
SharedRequest = tuple[int, int, Sequence[int], int, Sequence[int]]


def check_kv_sharing(value: str) -> str:
    if value not in KV_SHARING:
        raise ValueError(f"kv_sharing must be one of {', '.join(KV_SHARING)}; got {value!r}")
    return value


def prompt_blocks(prompt_len: int, block_size: int) -> int:
    """Logical blocks of a request that are prompt blocks (every plane)."""
    return -(-prompt_len // block_size)


def loop_table(request: SharedRequest, t: int, layers: int, num_blocks: int) -> list[int]:
    """Request's block table at loop ``t``, in blocks counted from its layer's first plane."""
    _, _, prompt, _, generated = request
    table = [b + t * layers * num_blocks for b in prompt]
    for g in generated:
        j, b = divmod(g, num_blocks)
        table.append(j * layers * num_blocks + b)
    return table


def build_shared_addressing(
    block_size: int,
    requests: Sequence[SharedRequest],
    num_blocks: int,
    layers: int,
    loops: int,
    offsets: Sequence[int] | None = None,
) -> KVAddressing:
    """Host addressing of a step's ``requests`` under decode KV sharing, rows in that order:
    one ``AttentionMetadata`` per loop, each checked on the host (slots in range, no slot
    written twice); and no physical block both a prompt block and a generated block's home.
    ``offsets``: per request, the loop its loop 0 is (depth-wise rows, which run one loop a
    step from the loop-0 metadata: loop ``t`` of such a request reads loop ``t + o``'s table,
    the last loop's past the end)."""
    prompt_homes: set[int] = set()
    gen_homes: set[int] = set()
    for _, _, prompt, prompt_len, generated in requests:
        need = prompt_blocks(prompt_len, block_size)
        if len(prompt) > need:
            raise IndexError(f"{len(prompt)} prompt blocks for a prompt of {prompt_len} tokens")
        prompt_homes.update(prompt)
        gen_homes.update(g % num_blocks for g in generated)
    clash = prompt_homes & gen_homes
    if clash:
        raise IndexError(f"blocks {sorted(clash)} hold both prompt and generated positions")
    reach = (loops * layers - layers + 1) * num_blocks * block_size  # from any layer's plane
    metas = []
    shift = offsets if offsets is not None else [0] * len(requests)
    for t in range(loops):
        tables = [
            (r[0], r[1], loop_table(r, min(t + o, loops - 1), layers, num_blocks))
            for r, o in zip(requests, shift, strict=True)
        ]
        metas.append(AttentionMetadata.build(block_size, tables, reach))
    return KVAddressing(layers, num_blocks * block_size, tuple(metas))
