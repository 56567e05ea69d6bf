"""Prefix caching and pages on demand (runtime_glue.engine.kv_manager, runtime_glue.engine.core).

In deterministic mode a cached prefix gives exactly the bits of computing it again, so every
engine test here compares bits with requests run alone with caching off. The pages are audited
after every step (reference counts equal to the block tables' uses, every page in exactly one
state), and all of them are free or cached again once the engine is idle. Two planted bugs (a
hash that ignores a token, a shared page left evictable) show that these checks catch what they
are for.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_glue.checks.parity import within_tolerance
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of
from tests.test_allocator import _Fence
from tests.test_engine import LOGIT_TOLERANCE

BS = 16
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _llm(ckpt, device="cpu", caching=True, num_blocks=64, deterministic=True, **kw):
    return LLM(
        ckpt,
        device=device,
        block_size=BS,
        num_blocks=num_blocks,
        deterministic=deterministic,
        enable_prefix_caching=caching,
        **kw,
    )


def drive(engine, prompts, params=PARAMS, stagger=0):
    """Run ``prompts`` to the end, one joining every ``stagger`` steps (all at once if 0),
    auditing the pages after every step; returns the requests, in order. Once idle, every
    page must be free or cached."""
    reqs, step = [], 0
    while len(reqs) < len(prompts) or engine.has_unfinished():
        while len(reqs) < len(prompts) and (stagger == 0 or step >= stagger * len(reqs)):
            rid = f"r{len(reqs)}-{engine.num_steps}"
            engine.add_request(rid, prompts[len(reqs)], params, return_logits=True)
            reqs.append(engine.requests[rid])
        engine.step()
        engine.audit_pages()
        step += 1
    engine.allocator.reclaim(wait=True)
    assert engine.allocator.num_free == engine.allocator.num_blocks, "pages were lost"
    return reqs


def alone(ckpt, prompts, params=PARAMS, device="cpu", deterministic=True):
    llm = _llm(ckpt, device, caching=False, deterministic=deterministic)
    return [llm.generate([p], params, return_logits=True)[0] for p in prompts]


def assert_same_bits(reqs, want):
    """``reqs`` (engine requests) ended well with the tokens and logits of ``want`` (outputs
    of LLM.generate, or other requests)."""
    for i, (req, w) in enumerate(zip(reqs, want, strict=True)):
        assert req.finish_reason in ("stop", "length"), (i, req.finish_reason, req.error)
        w_tokens, w_logits = (
            (w.token_ids, w.logits) if hasattr(w, "token_ids") else (w.output_ids, w.logits)
        )
        assert list(req.output_ids) == list(w_tokens), f"request {i}: tokens differ"
        assert torch.equal(torch.stack(req.logits), _stacked(w_logits)), f"request {i}: logits"


def _stacked(logits):
    return torch.stack(logits) if isinstance(logits, list) else logits


def cached_pages(engine, prompt):
    """The pages the prefix cache holds for ``prompt``'s full blocks."""
    hashes = engine.allocator.block_hashes(prompt, engine.prefix_salt + b"|")
    return engine.allocator.cached_prefix(hashes)


def shared_prefix_prompts(n=3, prefix_len=3 * BS + 5):
    prefix = prompt_of(prefix_len, seed=1)
    return [prefix + prompt_of(7 + i, seed=10 + i) for i in range(n)]


# -- the allocator alone --------------------------------------------------------------------


def test_block_hashes_chain_over_every_earlier_token_and_the_salt():
    alloc = BlockAllocator(8, 4)
    a = list(range(10, 22))  # three full blocks
    h = alloc.block_hashes(a, b"m")
    assert len(h) == 3 and len(set(h)) == 3
    assert alloc.block_hashes(a + [1, 2], b"m") == h  # a partial block gets no hash
    b = a[:5] + [99] + a[6:]  # differs in block 1
    hb = alloc.block_hashes(b, b"m")
    assert hb[0] == h[0] and hb[1] != h[1] and hb[2] != h[2]  # block 2's own tokens are equal
    assert set(alloc.block_hashes(a, b"other plan")).isdisjoint(h)


def test_a_referenced_block_is_never_evicted_and_unused_ones_go_least_recent_first():
    alloc = BlockAllocator(4, 4)
    h = alloc.block_hashes(list(range(16)), b"")
    x = alloc.allocate(2)
    for page, block_hash in zip(x, h, strict=False):
        alloc.register(page, block_hash)
    alloc.share(alloc.cached_prefix(h))  # a second user of both
    y = alloc.allocate(2)
    assert alloc.allocate(1) is None  # every page in use: "not now", nothing evicted
    alloc.free_after(x, None)  # the first user leaves; the sharer still holds them
    assert alloc.allocate(1) is None and alloc.cached_prefix(h) == x
    alloc.free_after(x, None)  # the last user leaves: both cached and evictable
    alloc.free_after(y, None)
    alloc.audit([])
    assert alloc.num_free == 4 and alloc.num_cached == 2
    got = alloc.allocate(3)  # two free pages, then the least recently used cached one
    assert set(got) == set(y) | {x[0]} and alloc.cached_prefix(h) == []  # the chain broke
    assert alloc.num_cached == 1
    alloc.audit([got])


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "finish", "tick"]),
        st.integers(0, 3),  # which of four prompts (they share prefixes) / which request
        st.integers(1, 40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(2, 10))
def test_random_sharing_lifecycles_keep_every_page_accounted_for(ops, num_blocks):
    """The engine's admission protocol (cached prefix shared, the rest allocated, full blocks
    registered) under random lifecycles and fences; the audit runs after every operation."""
    alloc = BlockAllocator(num_blocks, 4)
    base = list(range(100, 140))
    prompts = [base, base[:9] + [7] * 31, base[:20] + [8] * 20, [9] * 40]
    live: dict[int, list[int]] = {}
    fences: list[_Fence] = []
    for i, (op, which, n) in enumerate(ops):
        if op == "admit" and alloc.blocks_for(n) <= num_blocks:  # the engine validates that
            hashes = alloc.block_hashes(prompts[which][:n], b"")
            cached = alloc.cached_prefix(hashes[: (n - 1) // 4])
            alloc.share(cached)
            fresh = alloc.allocate(alloc.blocks_for(n) - len(cached))
            if fresh is None:
                alloc.free_after(cached, None)
            else:
                live[i] = cached + fresh
                for page, block_hash in zip(live[i], hashes, strict=False):
                    alloc.register(page, block_hash)
        elif op == "finish" and live:
            fence = _Fence()
            fences.append(fence)
            alloc.free_after(live.pop(sorted(live)[which % len(live)]), fence)
        elif op == "tick" and fences:
            fences[n % len(fences)].wait()
            alloc.reclaim()
        alloc.audit(list(live.values()))
    for table in live.values():
        alloc.free_after(table, None)
    alloc.reclaim(wait=True)
    alloc.audit([])
    assert alloc.num_free == num_blocks


# -- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "gqa-h256-d32-L3-T4"])
def test_requests_sharing_a_prefix_get_the_bits_they_get_alone_without_caching(
    checkpoints, driver_name, name
):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS.get(name, {}))
    prompts = shared_prefix_prompts()
    llm = _llm(ckpt, driver_name, prefill_chunk_size=BS)  # later requests join mid-prefill too
    reqs = drive(llm.engine, prompts, stagger=3)
    assert llm.engine.stats["prefix_cache_hits"] >= 2 * 3 * BS, llm.engine.stats
    assert_same_bits(reqs, alone(ckpt, prompts, device=driver_name))


def test_a_divergent_suffix_never_shares_its_block(tiny_ckpt):
    a = prompt_of(4 * BS, seed=3)
    b = a[: 2 * BS + 5] + prompt_of(2 * BS - 5, seed=4)  # parts inside block 2
    llm = _llm(tiny_ckpt)
    [ra] = drive(llm.engine, [a])
    of_a = cached_pages(llm.engine, a)
    assert len(of_a) == 4
    llm.engine.add_request("b", b, PARAMS, return_logits=True)
    rb = llm.engine.requests["b"]
    llm.engine.step()
    assert rb.blocks[:2] == of_a[:2]  # a's cached pages, shared
    assert not set(rb.blocks[2:]) & set(of_a)  # its own from the divergent block on
    assert llm.engine.stats["prefix_cache_hits"] == 2 * BS
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert_same_bits([ra, rb], alone(tiny_ckpt, [a, b]))


def test_a_cached_block_is_never_written_again(tiny_ckpt):
    """A prompt of whole blocks, twice: the second run shares all but the last block (its last
    token must be computed for its logits) and leaves the shared pages' bits untouched."""
    prompt = prompt_of(3 * BS, seed=5)
    llm = _llm(tiny_ckpt)
    [first] = drive(llm.engine, [prompt])
    shared = cached_pages(llm.engine, prompt)[:2]
    store = llm.kv_store
    slots = torch.tensor([p * BS + i for p in shared for i in range(BS)])
    before = (store.key_cache[:, slots].clone(), store.value_cache[:, slots].clone())
    [second] = drive(llm.engine, [prompt])
    assert llm.engine.stats["prefix_cache_hits"] == 2 * BS
    assert torch.equal(store.key_cache[:, slots], before[0])
    assert torch.equal(store.value_cache[:, slots], before[1])
    assert second.output_ids == first.output_ids


def test_requests_with_other_cache_salts_share_nothing(tiny_ckpt):
    prompts = shared_prefix_prompts(2)
    llm = _llm(tiny_ckpt)
    salted = [SamplingParams(max_tokens=6, ignore_eos=True, cache_salt=s) for s in "ab"]
    for prompt, params in zip(prompts, salted, strict=True):
        drive(llm.engine, [prompt], params)
    assert llm.engine.stats["prefix_cache_hits"] == 0
    drive(llm.engine, [prompts[0]], salted[1])  # b's salt, a's prompt: shares with b's prefix
    assert llm.engine.stats["prefix_cache_hits"] == 3 * BS


def test_abort_in_every_state_returns_every_page(tiny_ckpt):
    llm = _llm(tiny_ckpt, num_blocks=24, prefill_chunk_size=BS, max_num_seqs=2)
    eng = llm.engine
    prompts = shared_prefix_prompts(4)
    drive(eng, prompts[:1])  # the prefix is cached
    for i, prompt in enumerate(prompts):
        eng.add_request(f"x{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()  # x0, x1 running, sharing the prefix; x2, x3 waiting
    assert [r.request_id for r in eng.waiting] == ["x2", "x3"]
    eng.abort_request("x3")  # waiting
    eng.step()
    eng.abort_request("x0")  # sharing the prefix with x1
    for _ in range(3):
        eng.step()
        eng.audit_pages()
    eng.abort_request("x1")  # decoding
    while eng.has_unfinished():
        eng.step()
        eng.audit_pages()
    eng.allocator.reclaim(wait=True)
    eng.audit_pages()
    assert eng.allocator.num_free == eng.allocator.num_blocks
    assert eng.allocator.num_cached >= 3  # the prefix's blocks stay cached


def test_with_caching_off_nothing_is_cached(tiny_ckpt):
    llm = _llm(tiny_ckpt, caching=False)
    drive(llm.engine, shared_prefix_prompts(), stagger=3)
    assert llm.engine.stats["prefix_cache_hits"] == 0 and llm.engine.allocator.num_cached == 0


def test_caching_is_on_by_default_only_where_it_is_exact(tiny_ckpt):
    assert LLM(tiny_ckpt, num_blocks=4, deterministic=True).engine.config.enable_prefix_caching
    hf = LLM(tiny_ckpt, num_blocks=4, deterministic=False)
    assert not hf.engine.config.enable_prefix_caching
    # A variant shares the pool and the allocator, but its plan salts every hash apart.
    other = hf.variant(deterministic=True)
    assert other.engine.allocator is hf.engine.allocator
    assert other.engine.prefix_salt != hf.engine.prefix_salt


def test_in_hf_exact_mode_a_cached_prefix_stays_within_the_engines_tolerance(checkpoints):
    """HF-exact mode computed the cached prefix in another call shape (the first request's
    whole prompt) than a request alone would (its own prompt), so its bits may differ; the
    stated bound is the engine's LOGIT_TOLERANCE on the final loop's logits."""
    name = "gqa-h256-d32-L3-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = shared_prefix_prompts()
    llm = _llm(ckpt, deterministic=False, caching=True)
    reqs = drive(llm.engine, prompts, stagger=3)
    assert llm.engine.stats["prefix_cache_hits"] >= 2 * 3 * BS
    for req, want in zip(reqs, alone(ckpt, prompts, deterministic=False), strict=True):
        got = torch.stack(req.logits)
        check = within_tolerance(want.token_ids, want.logits, req.output_ids, got, LOGIT_TOLERANCE)
        assert check.passed, check


# -- pages on demand and preemption ---------------------------------------------------------


def run_all(ckpt, pool, prompts, max_tokens, eos=None):
    """All ``prompts`` at once (``max_tokens`` each) on a pool of ``pool`` blocks, auditing the
    pages after every step; returns the requests, the engine's stats and the most requests
    that one step gave a token."""
    llm = _llm(ckpt, num_blocks=pool, max_num_seqs=8)
    if eos is not None:
        llm.engine.sampler.eos = frozenset(eos)
    reqs, most = [], 0
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens(p), ignore_eos=eos is None)
        llm.engine.add_request(f"q{i}", p, params, return_logits=True)
        reqs.append(llm.engine.requests[f"q{i}"])
    while llm.engine.has_unfinished():
        most = max(most, len(llm.engine.step()))
        llm.engine.audit_pages()
    llm.engine.allocator.reclaim(wait=True)
    assert llm.engine.allocator.num_free == pool
    return reqs, llm.engine.stats, most


def test_a_pool_for_two_full_length_requests_serves_eight_that_stop_early(checkpoints):
    """max_tokens at the context limit, a pool of 2 x context: admission takes only the
    prompt's pages and decoding takes pages as it goes, so all eight run at once."""
    context = 256
    ckpt = checkpoints("short-context", seed=2, max_position_embeddings=context)
    prompts = [prompt_of(20 + 3 * i, seed=40 + i) for i in range(8)]
    # Every request stops within 60 tokens: the stop set holds one token from each request's
    # own greedy run (whatever tokens a CPU's GEMM path gives this random checkpoint).
    probe = _llm(ckpt, caching=False, num_blocks=8 * context // BS)
    outs = probe.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    eos = frozenset(out.token_ids[40] for out in outs)
    to_the_limit = lambda p: context - len(p)  # noqa: E731
    big, _, _ = run_all(ckpt, 8 * context // BS, prompts, to_the_limit, eos)
    small, stats, most = run_all(ckpt, 2 * context // BS, prompts, to_the_limit, eos)
    assert most == 8 and stats["failed"] == 0, stats
    assert all(r.finish_reason == "stop" and len(r.output_ids) <= 41 for r in small)
    assert_same_bits(small, big)


def test_a_pool_too_small_for_eight_completes_them_through_preemption(checkpoints):
    """Eight requests that need 40 pages on a pool of 12: the newest running request is
    preempted when the pool runs dry, recomputed later, and every request gets the tokens and
    bits it gets on a pool that never runs dry."""
    ckpt = checkpoints("tiny", seed=0)
    prompts = [prompt_of(20 + 3 * i, seed=40 + i) for i in range(8)]
    forty = lambda p: 40  # noqa: E731
    big, big_stats, _ = run_all(ckpt, 64, prompts, forty)
    small, stats, _ = run_all(ckpt, 12, prompts, forty)
    assert big_stats["preemptions"] == 0 and stats["preemptions"] > 0, stats
    assert stats["failed"] == 0
    assert_same_bits(small, big)


def test_a_request_that_can_never_fit_is_still_refused_with_both_numbers(tiny_ckpt):
    from runtime_glue.engine.core import InvalidRequest

    llm = _llm(tiny_ckpt, num_blocks=4)
    with pytest.raises(InvalidRequest, match=r"needs 70 tokens .* holds 64 tokens"):
        llm.engine.add_request("big", prompt_of(10), SamplingParams(max_tokens=60))


# -- planted bugs: the checks above catch them ----------------------------------------------


def test_a_planted_hash_that_ignores_a_token_is_caught(tiny_ckpt, monkeypatch):
    honest = BlockAllocator.block_hashes

    def ignores_last_token(self, tokens, salt):  # planted bug: each block's last token unseen
        masked = [0 if i % BS == BS - 1 else t for i, t in enumerate(tokens)]
        return honest(self, masked, salt)

    a = prompt_of(3 * BS + 4, seed=6)
    b = list(a)
    b[BS - 1] = (b[BS - 1] + 1) % 1000 + 3  # differs only where the planted hash is blind
    monkeypatch.setattr(BlockAllocator, "block_hashes", ignores_last_token)
    llm = _llm(tiny_ckpt)
    reqs = drive(llm.engine, [a, b], stagger=3)
    with pytest.raises(AssertionError, match="request 1"):
        assert_same_bits(reqs, alone(tiny_ckpt, [a, b]))


def test_a_planted_eviction_of_a_referenced_block_is_caught(tiny_ckpt, monkeypatch):
    honest = BlockAllocator.share

    def share_but_leave_evictable(self, pages):  # planted bug: a shared page stays evictable
        honest(self, pages)
        for page in pages:
            self._evictable[page] = None

    monkeypatch.setattr(BlockAllocator, "share", share_but_leave_evictable)
    llm = _llm(tiny_ckpt, num_blocks=12)
    with pytest.raises(AssertionError, match="not partitioned"):
        drive(llm.engine, shared_prefix_prompts(), stagger=3)


# -- through the server ---------------------------------------------------------------------


def test_the_server_shares_prefixes_preempts_and_shows_both_in_its_metrics(tiny_ckpt):
    """Eight concurrent openai-client requests with one long prefix on a 12-page pool: the
    texts of LLM.generate, hits and preemptions in /metrics, every page back once idle."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.server_helpers import ServerProcess
    from tests.test_server import _wait_idle

    prompts = shared_prefix_prompts(8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [o.text for o in _llm(tiny_ckpt, caching=False).generate(prompts, params)]
    server = ServerProcess(tiny_ckpt, "--num-blocks", "12")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="-", max_retries=0)

        def complete(prompt):
            return (
                client.completions.create(
                    model="toy",
                    prompt=prompt,
                    max_tokens=40,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                .choices[0]
                .text
            )

        assert complete(prompts[0]) == want[0]  # fills the cache
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, prompts)) == want
        m = _wait_idle(server)
        assert m["rlt_hal_prefix_cache_hits_total"] >= 8 * 3 * BS
        assert m["rlt_hal_prefix_cache_queries_total"] >= m["rlt_hal_prefix_cache_hits_total"]
        assert m["rlt_hal_preemptions_total"] > 0
        assert m["rlt_hal_kv_cached_blocks"] >= 3
    finally:
        server.stop()
