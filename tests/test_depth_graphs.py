"""Depth-wise steps replayed as step graphs (``--depth-batching --step-graphs``, issue 47) on
the EMULATED npu (a CPU test double for the hardware, ``drivers.npu.graphs``).

A depth-wise step has one shape per row count and sample count, whatever loops its rows are
at; its tokens' states stay in the store the graph reads and writes in place. Replay equals
the eager depth-wise step bit for bit in every mode, and in deterministic mode both equal plain
decoding (every loop runs: threshold 1.0), greedy and seeded, batched and chunked; a replayed
depth step makes no more host calls than a replayed plain decode step.
"""

from __future__ import annotations

import attrs
import pytest

from runtime_glue.engine import graph_buffers
from runtime_glue.engine.sampling import SamplingParams
from tests.test_step_graphs import MODES, _assert_same, _llm, _requests, _run


def _depth(ckpt, mode: str, graphs: bool, **options):
    return _llm(ckpt, mode, graphs, depth_batching=True, **options)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_replayed_depth_steps_give_the_eager_depth_steps_bits(tiny_ckpt, mode, batch):
    """Every exit rule a graph runs (last loop, a fixed loop, a threshold, a seeded sample)
    with requests joining and leaving at other steps: rows at different loops in one replay."""
    requests = _requests(batch)
    eager = _run(_depth(tiny_ckpt, mode, False), requests)
    llm = _depth(tiny_ckpt, mode, True)
    graphs = _run(llm, requests)
    _assert_same(eager, graphs)
    stats = llm.engine.graphs.stats
    assert stats["graph_steps"] >= 3 * 4 and stats["captures"] >= 2, stats
    assert llm.engine.stats["depth_rows"] > 0


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prefill", "chunked-prefill"])
def test_replayed_depth_steps_equal_plain_decoding_in_deterministic_mode(tiny_ckpt, chunk):
    """Threshold 1.0 (every token runs every loop): depth-wise steps replayed from graphs give
    plain decoding's tokens, exit loops and logits bit for bit, greedy and seeded."""
    greedy = SamplingParams(max_tokens=7, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3)
    requests = [
        (f"r{i}", prompt, params, True)
        for i, (prompt, params) in enumerate(
            [(r[1], greedy) for r in _requests(3)] + [(r[1], seeded) for r in _requests(2, seed=9)]
        )
    ]
    plain = _run(_llm(tiny_ckpt, "deterministic", False, prefill_chunk_size=chunk), requests)
    llm = _depth(tiny_ckpt, "deterministic", True, prefill_chunk_size=chunk)
    _assert_same(plain, _run(llm, requests))
    assert llm.engine.graphs.stats["graph_steps"] > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_with_adaptive_depth_replayed_depth_steps_give_the_eager_ones_bits(tiny_ckpt, mode):
    """Under adaptive depth a depth row leaves between steps (its exit rule read back with its
    step's picks), and the planes it skips are filled inside the step: step graphs combine
    with both. Replay equals eager; in deterministic mode both are adaptive depth's bits."""
    requests = _requests(4)
    kw = dict(adaptive_depth=True, exit_threshold=0.4)
    eager = _run(_depth(tiny_ckpt, mode, False, **kw), requests)
    llm = _depth(tiny_ckpt, mode, True, **kw)
    graphs = _run(llm, requests)
    _assert_same(eager, graphs)
    if mode == "deterministic":
        _assert_same(_run(_llm(tiny_ckpt, mode, False, **kw), requests), graphs)
    exits = [s for _, _, steps in graphs.values() for s in steps[1:]]
    assert any(s < 3 for s in exits), "some token left before the last loop"
    assert llm.engine.graphs.stats["graph_steps"] > 0


def test_adaptive_depth_with_graphs_is_refused_only_without_depth_batching(tiny_ckpt):
    with pytest.raises(ValueError, match="with --depth-batching rows leave between steps"):
        _llm(tiny_ckpt, "deterministic", True, adaptive_depth=True)


def test_depth_graphs_are_admitted_by_a_replay_at_other_loops(tiny_ckpt):
    llm = _depth(tiny_ckpt, "deterministic", True)
    [admission] = [a for a in llm.plan.admissions if a.op == "step_graphs"]
    assert admission.admitted, admission.why
    assert "depth-wise row(s)" in admission.why
    assert llm.engine.builder.depth.held() == 0  # the check's tokens gave their slots back


def test_a_replayed_depth_step_makes_no_more_host_calls_than_a_plain_decode_step(tiny_ckpt):
    from runtime_glue.bench.graph_bench import host_calls_by_kind

    plain = host_calls_by_kind(_llm(tiny_ckpt, "deterministic", True))
    assert set(plain) == {"decode"}
    for kw in ({}, dict(adaptive_depth=True, exit_threshold=0.4)):  # with exits: the fill too
        depth = host_calls_by_kind(_depth(tiny_ckpt, "deterministic", True, **kw))
        assert set(depth) == {"depth"}
        assert 0 < depth["depth"] <= plain["decode"], (kw, depth, plain)


def test_a_graph_that_carries_states_beside_the_store_is_caught(tiny_ckpt, monkeypatch):
    """The double the tests above stand on: a graph that writes its rows' states into a copy
    of the store made at capture (not the store itself) loses them between steps: refused by
    the start-up check or, if it slips through, not the eager steps' bits."""
    requests = _requests(3)
    eager = _run(_depth(tiny_ckpt, "deterministic", False), requests)
    real = graph_buffers._depth_inputs

    def beside(buf, whole):
        step = real(buf, whole)
        copy = step.depth.states.clone()
        return attrs.evolve(step, depth=attrs.evolve(step.depth, states=copy))

    monkeypatch.setattr(graph_buffers, "_depth_inputs", beside)
    llm = _depth(tiny_ckpt, "deterministic", True)
    [admission] = [a for a in llm.plan.admissions if a.op == "step_graphs"]
    if not admission.admitted:
        assert "differs from the eager step" in admission.why
        return
    with pytest.raises(AssertionError, match="differ"):
        _assert_same(eager, _run(llm, requests))
