"""Depth-wise batching (``--depth-batching``, issue 47, docs/depth-batching.md): a generated
token runs one loop a step, beside prompt rows and other tokens at other loops in one pass over
the layers (its attention shifted to its own loop's planes), its states kept between steps in
the engine's depth store (with ``--adaptive-depth`` it may leave after any loop). Every loop still runs, so in deterministic mode (row-invariant kernels) the
tokens and logits are plain decoding's bit for bit, whatever the batch mix, on the cpu and
the emulated npu (a CPU test double)."""

from __future__ import annotations

import pytest
import torch

from runtime_glue.engine import kv_placement
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.model import OuroModel
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of
from tests.test_speculative import GQA, assert_same, greedy, jobs_of, run

DRIVERS = ["cpu", "npu"]


@pytest.fixture(scope="module")
def gqa(checkpoints):
    return checkpoints(GQA, **PARITY_CONFIGS[GQA])


def _pair(ckpt, driver: str, **kw) -> tuple[LLM, LLM]:
    base = dict(device=driver, block_size=16, num_blocks=64, deterministic=True, **kw)
    return LLM(ckpt, **base), LLM(ckpt, depth_batching=True, **base)


@pytest.mark.parametrize("driver", DRIVERS, ids=["cpu", "npu-emulated"])
def test_greedy_tokens_and_logits_equal_plain_decoding_bit_for_bit(gqa, driver):
    """Requests joining a step apart and leaving at different steps: prompt rows share steps
    with tokens at every loop."""
    plain, depth = _pair(gqa, driver)
    jobs = jobs_of(plain)
    assert_same(run(depth, jobs), run(plain, jobs))
    T = depth.config.total_ut_steps
    generated = sum(p.max_tokens for _, p in jobs) - len(jobs)  # the first comes from prefill
    assert depth.engine.stats["depth_rows"] == T * generated
    assert plain.engine.stats["depth_rows"] == 0


@pytest.mark.parametrize(
    "kw",
    [dict(exit_threshold=0.5), dict(exit_at_step=1), dict(prefill_chunk_size=7)],
    ids=["threshold", "exit-at-step", "chunked-prefill"],
)
def test_exit_modes_and_chunked_prefill_equal_plain_decoding(gqa, kw):
    plain, depth = _pair(gqa, "cpu", **kw)
    jobs = jobs_of(plain)
    assert_same(run(depth, jobs), run(plain, jobs))


@pytest.mark.parametrize("kw", [{}, dict(adaptive_depth=True)], ids=["full-depth", "adaptive"])
def test_per_request_exit_modes_in_one_batch_equal_the_reference(gqa, kw):
    """A weighted exit (every loop's logits by the exit distribution), a fixed loop and a
    threshold side by side in one batch of depth rows (under adaptive depth only the
    threshold's row may leave early)."""
    plain, depth = _pair(gqa, "cpu", **kw)
    jobs = [
        (prompt_of(6, seed=11), greedy(8, weighted_exit=True)),
        (prompt_of(9, seed=12), greedy(6, exit_at_step=2)),
        (prompt_of(4, seed=13), greedy(7, exit_threshold=0.6)),
    ]
    assert_same(run(depth, jobs), run(plain, jobs))


def test_sampling_penalties_and_logprobs_equal_plain_decoding(gqa):
    plain, depth = _pair(gqa, "cpu")
    jobs = [
        (
            prompt_of(6, seed=1),
            SamplingParams(max_tokens=9, temperature=0.9, seed=4, ignore_eos=True),
        ),
        (prompt_of(11, seed=2), greedy(7, repetition_penalty=1.4, logprobs=3)),
    ]
    assert_same(run(depth, jobs), run(plain, jobs))
    got = depth.generate([p for p, _ in jobs], [p for _, p in jobs])
    want = plain.generate([p for p, _ in jobs], [p for _, p in jobs])
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_a_depth_only_step_runs_the_layers_once(gqa, monkeypatch):
    """A step of generated tokens only is one pass over the layers (one ``loop`` call), a
    prefill step T: a token costs T steps of one pass each."""
    _, depth = _pair(gqa, "cpu")
    model = depth.engine.model
    calls: list[int] = []
    real = model.loop
    monkeypatch.setattr(model, "loop", lambda t, *a: calls.append(t) or real(t, *a))
    engine = depth.engine
    engine.add_request("a", prompt_of(8, seed=3), greedy(3))
    engine.step()  # the prompt, every loop, and its first token
    T = depth.config.total_ut_steps
    assert calls == list(range(T))
    for _ in range(T):
        calls.clear()
        assert not engine.requests["a"].output_ids[1:], "a token before its last loop"
        engine.step()
        assert calls == [0]  # one pass, whatever loop the token is at
    assert len(engine.requests["a"].output_ids) == 2


def test_preemption_part_way_through_a_token_recomputes_the_same_bits(tiny_ckpt):
    prompts = [prompt_of(10, seed=s) for s in range(4)]
    params = greedy(100)
    roomy = LLM(tiny_ckpt, block_size=16, num_blocks=64, deterministic=True)
    want = [roomy.generate([p], params, return_logits=True)[0] for p in prompts]
    tight = LLM(tiny_ckpt, block_size=16, num_blocks=20, deterministic=True, depth_batching=True)
    got = run(tight, [(p, params) for p in prompts])  # audits every page after every step
    assert tight.engine.stats["preemptions"] > 0, "the pool should have run dry"
    for (tokens, logits), w in zip(got, want, strict=True):
        assert tuple(tokens) == w.token_ids
        assert torch.equal(logits, w.logits)
    assert tight.engine.num_free_blocks == 20, "every block is back in the pool"


@pytest.mark.parametrize("driver", DRIVERS, ids=["cpu", "npu-emulated"])
def test_with_adaptive_depth_a_token_leaves_at_its_exit_loop_with_adaptive_depths_bits(gqa, driver):
    """Milestone 2: under ``--adaptive-depth`` a depth row whose exit rule reaches its
    threshold after loop t is sampled there and leaves (the planes it skips get its loop-t
    K/V, as adaptive depth fills them): adaptive depth's tokens, logits and exit loops bit for
    bit, each token running only its loops 0 .. t."""
    adaptive, depth = _pair(gqa, driver, adaptive_depth=True, exit_threshold=0.5)
    jobs = jobs_of(adaptive)
    assert_same(run(depth, jobs), run(adaptive, jobs))
    got = depth.generate([p for p, _ in jobs], [p for _, p in jobs])
    want = adaptive.generate([p for p, _ in jobs], [p for _, p in jobs])
    loops = 0
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].exit_steps == w.outputs[0].exit_steps
        loops += sum(t + 1 for t in w.outputs[0].exit_steps[1:])  # the first: from prefill
    T = depth.config.total_ut_steps
    generated = sum(len(w.outputs[0].exit_steps) - 1 for w in want)
    before = depth.engine.stats["depth_rows"]
    depth.generate([p for p, _ in jobs], [p for _, p in jobs])
    ran = depth.engine.stats["depth_rows"] - before
    assert ran == loops < T * generated, "each token runs its loops up to its exit, no more"


@pytest.mark.parametrize(
    "kw", [{}, dict(adaptive_depth=True, exit_threshold=0.5)], ids=["full-depth", "adaptive"]
)
def test_under_kv_sharing_depth_rows_read_the_planes_sharing_gives_their_loop(gqa, kw):
    """Decode KV sharing keeps a generated position's K/V in one plane per layer that every
    loop writes and reads; a depth row at loop t reads loop t's tables (prompt planes of loop
    t, the shared generated planes): kv sharing's bits, bit for bit, with and without exits."""
    sharing, depth = _pair(gqa, "cpu", kv_sharing="last", **kw)
    jobs = jobs_of(sharing)
    assert_same(run(depth, jobs), run(sharing, jobs))
    assert depth.engine.stats["depth_rows"] > 0


def test_a_planted_shared_table_at_the_wrong_loop_is_caught(gqa, monkeypatch):
    """Under sharing, depth rows addressed with loop 0's tables (the offsets dropped) read and
    write the wrong prompt planes: not kv sharing's bits."""
    sharing, depth = _pair(gqa, "cpu", kv_sharing="last")
    jobs = jobs_of(sharing)
    want = run(sharing, jobs)
    real = kv_placement.build_shared_addressing
    monkeypatch.setattr(
        kv_placement,
        "build_shared_addressing",
        lambda bs, requests, nb, layers, loops, offsets=None: real(bs, requests, nb, layers, loops),
    )
    with pytest.raises(AssertionError, match="request"):
        assert_same(run(depth, jobs), want)


def test_a_planted_missing_fill_of_the_skipped_planes_is_caught(gqa, monkeypatch):
    """The planes a leaving token skips are read by later tokens: without adaptive depth's
    fill (done in the step, for every row that may leave) the tokens or logits differ."""
    adaptive, depth = _pair(gqa, "cpu", adaptive_depth=True, exit_threshold=0.5)
    jobs = jobs_of(adaptive)
    want = run(adaptive, jobs)
    monkeypatch.setattr(OuroModel, "_depth_fill", lambda *a: None)
    with pytest.raises(AssertionError, match="request"):
        assert_same(run(depth, jobs), want)


def test_a_planted_stale_carried_state_is_caught(gqa, monkeypatch):
    """The double the tests above stand on: a token that goes on from a stale state (rows past
    loop 0 not written to the store, so the next loop reads an older one) must not pass as
    plain decoding."""
    plain, depth = _pair(gqa, "cpu")
    jobs = jobs_of(plain)
    want = run(plain, jobs)
    real = OuroModel._depth_pass

    def stale(self, x, rows, step):
        before = rows.states.clone()
        kept = real(self, x, rows, step)
        past = rows.loops > 0
        at = (rows.slots[past], rows.loops[past])
        rows.states.index_put_(at, before[at])
        return kept

    monkeypatch.setattr(OuroModel, "_depth_pass", stale)
    with pytest.raises(AssertionError, match="request 0"):
        assert_same(run(depth, jobs), want)


def test_every_token_frees_its_state_slot(tiny_ckpt):
    """A slot of the store is held while its token is in flight: with two slots, the tokens of
    five requests (one aborted part-way through a token) take turns in them, and when the run
    ends none is held."""
    _, depth = _pair(tiny_ckpt, "cpu", max_num_seqs=2)
    engine, store = depth.engine, depth.engine.builder.depth
    taken: list[int] = []
    real = store.token

    def token(req):
        fresh = req.depth is None
        got = real(req)
        if fresh:
            taken.append(got.slot)
        return got

    store.token = token
    for i in range(5):
        engine.add_request(f"r{i}", prompt_of(5 + i, seed=i), greedy(4))
    aborted = False
    while engine.has_unfinished():
        engine.step()
        victim = engine.requests.get("r1")
        midway = victim is not None and victim.depth is not None and victim.depth.loop > 0
        if midway and not aborted:  # part-way through a token
            aborted = engine.abort_request("r1")
    assert aborted and store.held() == 0
    assert set(taken) == {0, 1} and len(taken) > 2 * 2, taken  # every slot, several tokens each


def test_metrics_count_the_loops_run_depth_wise(gqa):
    from prometheus_client.parser import text_string_to_metric_families

    from runtime_glue.server.metrics import Metrics

    _, depth = _pair(gqa, "cpu")
    depth.generate([prompt_of(5, seed=9)], greedy(3))
    metrics = Metrics(total_blocks=64)
    metrics.sync_counters(depth.engine.stats)
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples["rlt_hal_depth_rows_total"] == depth.config.total_ut_steps * 2


@pytest.mark.parametrize(
    "kw", [{}, dict(adaptive_depth=True, exit_threshold=0.5)], ids=["full-depth", "adaptive"]
)
def test_structured_outputs_and_n_samples_through_depth_rows(tiny_ckpt, kw):
    """A grammar masks a depth row's token only where it is sampled (its last loop, or a loop
    it may leave after, whose token is dropped if it does not: the matcher moves only on
    emitted tokens), and n > 1 forks from the prompt: the reference's outputs and logits."""
    from tests.test_sampling_stage import JSON, PROMPT, REGEX

    plain, depth = _pair(tiny_ckpt, "cpu", **kw)
    for params in (
        SamplingParams(max_tokens=40, structured_outputs=JSON),
        SamplingParams(max_tokens=30, temperature=0.9, seed=5, structured_outputs=REGEX),
        SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=7, ignore_eos=True),
    ):
        [want] = plain.generate([PROMPT], params, return_logits=True)
        [got] = depth.generate([PROMPT], params, return_logits=True)
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert g.token_ids == w.token_ids
            assert torch.equal(g.logits, w.logits)
    assert depth.engine.stats["depth_rows"] > 0


def test_bench_ops_counts_a_depth_token_over_its_steps(tiny_ckpt):
    """``bench ops`` counts a depth-wise token's device ops over the T steps that make it."""
    from runtime_glue.bench.ops_bench import count_decode

    plain, depth = _pair(tiny_ckpt, "npu")
    T = depth.config.total_ut_steps
    got, want = count_decode(depth), count_decode(plain)
    assert set(got["by_step_kind"]) == {"depth"} and set(want["by_step_kind"]) == {"decode"}
    assert got["steps_per_decode_token"] == T and want["steps_per_decode_token"] == 1
    one_pass = got["by_step_kind"]["depth"]["device_ops_per_step"]
    assert got["device_ops_per_decode_token"] >= T * one_pass * 0.9
