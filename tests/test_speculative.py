"""Exact self-speculative decoding (runtime_glue.engine.speculative): drafts from the first E
loops, verified by the rest, give bit for bit the tokens and logits of plain decoding in
deterministic mode, on every driver, for every E, K, chunk size and batch mix."""

from __future__ import annotations

import attrs
import pytest
import torch

from runtime_glue.engine.core import InvalidRequest
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.speculative import Speculator
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

PROMPTS = [prompt_of(5, seed=1), prompt_of(19, seed=2), prompt_of(33, seed=3)]
MAX_NEW = [14, 9, 17]  # requests leave the batch at different steps


def run(llm: LLM, jobs: list[tuple[list[int], SamplingParams]], audit: bool = True):
    """Every job through the engine together (joining one step apart): (tokens, logits)."""
    engine = llm.engine
    ids = []
    pending = list(jobs)
    while pending or engine.has_unfinished():
        if pending:
            prompt, params = pending.pop(0)
            rid = f"job-{len(ids)}-{id(params)}"
            engine.add_request(rid, prompt, params, return_logits=True)
            ids.append((rid, engine.requests[rid]))
        engine.step()
        if audit:
            engine.audit_pages()
    out = []
    for _, req in ids:
        assert req.finish_reason != "error", req.error
        out.append((list(req.output_ids), torch.stack(req.logits)))
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_same(got, want) -> None:
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(got, want, strict=True)):
        assert tokens == ref_tokens, f"request {i}: tokens {tokens} != {ref_tokens}"
        assert torch.equal(logits, ref_logits), (
            f"request {i}: logits differ by {(logits - ref_logits).abs().max().item()}"
        )


GQA = "gqa-h64-d32-L2-T4"


@pytest.fixture(scope="module", params=[GQA, "wide-h2048-d128-L1-T4"])
def ckpt(request, checkpoints):
    return checkpoints(request.param, **PARITY_CONFIGS[request.param])


_BASES: dict = {}  # (checkpoint, driver) -> (LLM, plain decoding's outputs), built once
WIDE_DRIVERS = ("cpu",)  # the wide config's start-up check and steps are slow under emulation


def jobs_of(llm: LLM, **kw) -> list[tuple[list[int], SamplingParams]]:
    """Requests joining a step apart and leaving at different steps (two shorter ones at
    hidden 2048)."""
    if llm.config.hidden_size >= 2048:
        return [(PROMPTS[0], greedy(8, **kw)), (PROMPTS[1], greedy(6, **kw))]
    return [(p, greedy(n, **kw)) for p, n in zip(PROMPTS, MAX_NEW, strict=True)]


def _base(ckpt, driver_name):
    if (ckpt, driver_name) not in _BASES:
        llm = LLM(ckpt, device=driver_name, block_size=16, num_blocks=64, deterministic=True)
        _BASES[(ckpt, driver_name)] = llm, run(llm, jobs_of(llm))
    return _BASES[(ckpt, driver_name)]


@pytest.fixture
def base(ckpt, driver_name):
    if "wide" in str(ckpt) and driver_name not in WIDE_DRIVERS:
        pytest.skip("the wide config runs on cpu; the emulated npu runs the gqa config")
    return _base(ckpt, driver_name)


@pytest.fixture
def gqa_base(checkpoints, driver_name):
    return _base(checkpoints(GQA, **PARITY_CONFIGS[GQA]), driver_name)


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_greedy_tokens_and_logits_equal_plain_decoding_for_every_e_and_k(base, loops):
    llm, want = base
    spec = llm.with_speculation(loops, tokens=6)
    for k in (3,) if llm.config.hidden_size >= 2048 else (1, 3, 6):  # per request
        assert_same(run(spec, jobs_of(llm, num_speculative_tokens=k)), want)
    stats = spec.engine.stats
    assert stats["spec_verify_steps"] > 0 and stats["spec_drafted"] > 0


def test_a_batch_mixing_speculative_and_plain_requests_is_still_exact(base):
    llm, want = base
    spec = llm.with_speculation(2, tokens=4)
    jobs = jobs_of(llm)
    ks = [0, 4, 2][: len(jobs)]  # 0: this request does not draft
    jobs = [
        (p, attrs.evolve(q, num_speculative_tokens=k)) for (p, q), k in zip(jobs, ks, strict=True)
    ]
    assert_same(run(spec, jobs), want)


def test_drafts_are_both_accepted_and_rejected_across_the_suite_prompts(base):
    """The identity tests exercise both paths: some drafts accepted, some rejected."""
    llm, _ = base
    spec = llm.with_speculation(3, tokens=4)
    run(spec, jobs_of(llm))
    s = spec.engine.stats
    assert 0 < s["spec_accepted"] < s["spec_drafted"], s


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_with_speculation_is_exact(checkpoints, driver_name, gqa_base, chunk):
    _, want = gqa_base
    llm = LLM(
        checkpoints(GQA, **PARITY_CONFIGS[GQA]),
        device=driver_name,
        block_size=16,
        num_blocks=64,
        deterministic=True,
        prefill_chunk_size=chunk,
        speculative_loops=1,
        num_speculative_tokens=3,
    )
    assert_same(run(llm, jobs_of(llm)), want)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(base):
    llm, _ = base
    spec = llm.with_speculation(2, tokens=3)
    jobs = [
        (p, attrs.evolve(q, temperature=0.8, top_p=0.9, seed=11 + i))
        for i, (p, q) in enumerate(jobs_of(llm))
    ]
    assert_same(run(spec, jobs), run(llm, jobs))


# -- planted bugs: the identity check must catch them ----------------------------------------


def test_accepting_one_token_too_many_is_caught(gqa_base, monkeypatch):
    llm, want = gqa_base
    spec = llm.with_speculation(1, tokens=4)
    original = Speculator.verified

    def one_too_many(self, req, tokens):
        k = req.spec.k
        accepted = original(self, req, tokens)
        return tokens[: len(accepted) + 1] if len(accepted) <= k else accepted

    monkeypatch.setattr(Speculator, "verified", one_too_many)
    with pytest.raises(AssertionError):
        assert_same(run(spec, jobs_of(llm), audit=False), want)


def test_a_verify_step_reading_a_rejected_drafts_kv_is_caught(gqa_base, monkeypatch):
    """Planted: the verify step does not write its first row's K/V in the later loops, so the
    rows after it read what the last round's rejected draft left in that slot."""
    llm, want = gqa_base
    E, K = 2, 3
    spec = llm.with_speculation(E, tokens=K)
    store, first_late_plane = spec.kv_store, E * spec.config.num_hidden_layers
    write = store.write

    def stale_first_row(plane, key, value, slots):
        if plane >= first_late_plane and slots.shape[0] == K + 1:
            key, value, slots = key[1:], value[1:], slots[1:]
        return write(plane, key, value, slots)

    monkeypatch.setattr(store, "write", stale_first_row)
    backend, bind = spec.model.backend, spec.model.backend.bind
    rows_of = (store.key_cache.flatten(0, 1), store.value_cache.flatten(0, 1))

    def stale_bound(kv, meta, scaling, deterministic):  # the same bug in a bound decode loop
        bound = bind(kv, meta, scaling, deterministic)

        def write(plane, key, value):
            if plane < first_late_plane or key.shape[0] != K + 1:
                return bound.write(plane, key, value)
            slot = plane * store.layout.num_slots + int(meta.slot_mapping[0])
            kept = [rows[slot].clone() for rows in rows_of]
            bound.write(plane, key, value)
            for rows, old in zip(rows_of, kept, strict=True):
                rows[slot] = old

        return type(bound)(write, bound.attend, bound.operands)

    monkeypatch.setattr(backend, "bind", stale_bound)
    with pytest.raises(AssertionError):
        assert_same(run(spec, jobs_of(llm), audit=False), want)


# -- the engine around it -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64, deterministic=True)


def test_preemption_mid_round_recomputes_and_stays_exact(tiny_ckpt):
    prompts = [prompt_of(20, seed=s) for s in range(4)]
    jobs = [(p, greedy(24)) for p in prompts]
    roomy = LLM(tiny_ckpt, block_size=16, num_blocks=64, deterministic=True)
    want = run(roomy, jobs)
    tight = LLM(
        tiny_ckpt,
        block_size=16,
        num_blocks=8,  # four requests of 44 tokens need 12 pages; three running need 9
        deterministic=True,
        speculative_loops=2,
        num_speculative_tokens=5,
    )
    assert_same(run(tight, jobs), want)
    assert tight.engine.stats["preemptions"] > 0
    assert tight.engine.stats["spec_verify_steps"] > 0


def test_prefix_cache_hits_stay_exact_under_speculation(tiny):
    shared = prompt_of(40, seed=7)
    jobs = [(shared + prompt_of(3, seed=s), greedy(12)) for s in (1, 2)]
    want = [run(tiny, [job])[0] for job in jobs]  # one at a time: the second hits the cache
    spec = tiny.with_speculation(1, tokens=3)
    got = [run(spec, [job])[0] for job in jobs]
    assert_same(got, want)
    assert spec.engine.stats["prefix_cache_hits"] > 0


def test_stop_strings_and_max_tokens_end_a_round_where_plain_decoding_ends(tiny):
    prompt = prompt_of(6, seed=9)
    free = tiny.generate([prompt], greedy(16))[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    spec = tiny.with_speculation(1, tokens=5)
    for params in (greedy(16, stop=[stop]), greedy(7), greedy(1)):
        plain, fast = tiny.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (fast.token_ids, fast.text, fast.finish_reason) == (
            plain.token_ids,
            plain.text,
            plain.finish_reason,
        )


def test_an_aborted_request_mid_round_frees_every_page(tiny):
    spec = tiny.with_speculation(2, tokens=4)
    engine = spec.engine
    free = engine.num_free_blocks
    engine.add_request("a", prompt_of(30, seed=1), greedy(40))
    for _ in range(4):
        engine.step()
    assert engine.requests["a"].spec is not None  # mid-round
    assert engine.abort_request("a")
    engine.audit_pages()
    assert engine.num_free_blocks == free


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative_loops=0), r"speculative_loops must be in \[1, 3\]"),
        (dict(speculative_loops=4), r"speculative_loops must be in \[1, 3\]"),
        (dict(speculative_loops=1, num_speculative_tokens=0), "num_speculative_tokens must be"),
        (dict(num_speculative_tokens=3), "needs speculative_loops"),
        (dict(speculative_loops=1, adaptive_depth=True), "cannot be combined with --adaptive"),
    ],
)
def test_impossible_speculation_settings_are_refused(tiny_ckpt, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_ckpt, block_size=16, num_blocks=8, **options)


def test_a_request_asking_for_drafts_from_an_engine_without_them_is_refused(tiny):
    with pytest.raises(InvalidRequest, match="needs an engine started with --speculative"):
        tiny.generate([prompt_of(4)], greedy(4, num_speculative_tokens=2))


def test_in_hf_exact_mode_speculation_keeps_the_batching_tolerance(checkpoints):
    """HF-exact mode: a verify step is another call shape (k + 1 rows where plain decoding
    issues one), so the bits are those of a batched call: the same tokens on these prompts,
    logits within the 0.5 that batching and chunking already allow (docs/determinism.md)."""
    name = "wide-h2048-d128-L1-T4"
    llm = LLM(
        checkpoints(name, **PARITY_CONFIGS[name]), block_size=16, num_blocks=64, deterministic=False
    )
    assert llm.mode == "hf-exact"
    jobs = [(p, greedy(8)) for p in PROMPTS[:2]]
    want = run(llm, jobs)
    got = run(llm.with_speculation(2, tokens=3), jobs)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert (logits - ref_logits).abs().max().item() <= 0.5


# -- the server -----------------------------------------------------------------------------


def test_a_speculative_server_answers_as_plain_decoding_and_counts_its_drafts(tiny_ckpt, tiny):
    import openai

    from tests.server_helpers import ServerProcess

    server = ServerProcess(tiny_ckpt, "--speculative-loops", "2", "--num-speculative-tokens", "3")
    try:
        assert "speculative decoding on: 3 drafts from loops 0..1" in server.output()
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
        prompt = prompt_of(8, seed=5)
        want = tiny.generate([prompt], greedy(12))[0].text
        for extra in ({}, {"num_speculative_tokens": 1}, {"num_speculative_tokens": 0}):
            got = client.completions.create(
                model="toy",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True, **extra},
            )
            assert got.choices[0].text == want
        with pytest.raises(openai.BadRequestError):
            client.completions.create(
                model="toy", prompt="x", max_tokens=2, extra_body={"num_speculative_tokens": 64}
            )
        m = server.metrics()
        assert m["rlt_hal_spec_verify_steps_total"] > 0
        assert m["rlt_hal_spec_drafted_total"] >= m["rlt_hal_spec_accepted_total"]
        assert m["rlt_hal_spec_accepted_per_verify_count"] == m["rlt_hal_spec_verify_steps_total"]
    finally:
        server.stop()


def test_bench_speculative_reports_the_grid_against_plain_decoding(tmp_path):
    from tests.test_bench import _bench

    report, table = _bench(
        tmp_path,
        "speculative --preset tiny --input-len 8 --output-len 6 --runs 1 --concurrency 2 "
        "--block-size 16 --loops-grid 1,3 --tokens-grid 2",
    )
    assert set(report["levels"]) == {"c1", "c2"}
    for level in report["levels"].values():
        assert [(g["E"], g["K"]) for g in level["grid"]] == [(1, 2), (3, 2)]
        for g in level["grid"]:
            assert (
                g["identical"]
                and g["prefix_agreement"] == 1.0
                and g["tpot_s"] > 0
                and g["tok_s"] > 0
            )
            assert 1 <= g["tokens_per_verify"] <= 3
            d, v = g["draft_step_s"], g["verify_step_s"]
            assert g["tpot_at_acceptance_0_s"] == pytest.approx(3 * d + v)
            assert g["tpot_at_acceptance_1_s"] == pytest.approx((3 * d + v) / 3)
    assert "| 1 | 2 |" in table and "yes" in table


def test_prefix_agreement_counts_plain_decodings_tokens_before_the_first_difference():
    from runtime_glue.bench.speculative_bench import prefix_agreement

    plain = [{"tokens": [[1, 2, 3, 4], [5, 6]]}, {"tokens": [[7, 8, 9, 10]]}]
    assert prefix_agreement(plain, plain) == 1.0
    parted = [{"tokens": [[1, 2, 0, 4], [5, 6]]}, {"tokens": [[0, 8, 9, 10]]}]
    assert prefix_agreement(parted, plain) == (2 + 2 + 0) / 10  # what follows a parting is lost
    short = [{"tokens": [[1, 2], [5, 6]]}, {"tokens": [[7, 8, 9, 10]]}]  # stopped early
    assert prefix_agreement(short, plain) == 8 / 10


def test_bench_speculative_counts_host_calls_per_token_under_step_graphs(tmp_path, monkeypatch):
    """On the EMULATED npu in fast mode: draft and verify steps replayed (a few host calls
    each), plain decoding 4 per token. It once never finished: every engine the bench builds
    took scratch pages of its own from a pool sized without them."""
    from tests.test_bench import _bench

    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    report, _ = _bench(
        tmp_path,
        "speculative --preset tiny --device npu --mode fast --step-graphs --input-len 8 "
        "--output-len 12 --runs 1 --concurrency 1 --block-size 16 --loops-grid 1 --tokens-grid 3",
    )
    calls = report["host_calls_per_token"]
    assert report["step_graphs"] == "npu_graph (emulated)" and calls["plain"] == 4
    # a round: 4 draft steps and a verify step, replayed, for 1 to 4 tokens (eager: hundreds)
    assert 4 < calls["E1K3"] < 100 and report["levels"]["c1"]["grid"][0]["identical"]


def test_speculation_refuses_kv_sharing_saying_why(tiny_ckpt):
    with pytest.raises(ValueError, match="cannot be combined with --kv-sharing last: under kv"):
        LLM(tiny_ckpt, speculative_loops=1, kv_sharing="last")
