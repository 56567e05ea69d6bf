"""Step graphs (``--step-graphs``) on the EMULATED npu: replay equals eager, bit for bit.

Every case runs the same requests through two engines on the emulated torch_npu (a test
double for the hardware, ``drivers.npu.graphs``): one eager, one that captures decode-only
steps and replays them, and compares every token and every logit exactly. The graphs' engine
has one more KV block: its scratch page for padding rows, so both schedule alike.

Then the double itself: it must catch what a real graph would silently get wrong.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from drivers.npu.emulation import EmulatedTorchNpu
from drivers.npu.graphs import GraphCaptureError, GraphReplayError, _npu_op
from runtime_glue.engine import graph_buffers
from runtime_glue.engine import graphs as engine_graphs
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import prompt_of

# name -> LLM options selecting the plan mode. At block size 16 the fast plan keeps
# ascend_eager attention beside its fused kernels (ascend_fia needs multiples of 128).
MODES = {
    "deterministic": dict(deterministic=True),
    "hf-exact": dict(deterministic=False),
    "fast": dict(mode="fast"),
}
# ... and the fast plan with ascend_fia, whose decode form captured steps replay.
WITH_FIA = {**MODES, "fast-fia": dict(mode="fast", block_size=128)}
BS = 16


def _llm(ckpt, mode: str, graphs: bool, num_blocks: int = 24, **options) -> LLM:
    options = {"block_size": BS, **WITH_FIA[mode], **options}
    return LLM(
        ckpt,
        device="npu",
        num_blocks=num_blocks + (1 if graphs else 0),
        max_num_seqs=4,
        step_graphs=graphs,
        **options,
    )


def _run(llm: LLM, requests, abort: dict[int, str] | None = None):
    """Step ``llm``'s engine over ``requests`` ((id, prompt, params, return_logits) each),
    aborting ``abort[step]`` before that step; every live request's tokens and logits."""
    engine = llm.engine
    for rid, prompt, params, logits in requests:
        engine.add_request(rid, prompt, params, logits)
    reqs = {rid: engine.requests[rid] for rid, *_ in requests}
    step = 0
    while engine.has_unfinished():
        if abort and step in abort:
            engine.abort_request(abort[step])
        engine.step()
        engine.audit_pages()
        step += 1
    for req in reqs.values():
        assert req.finish_reason != "error", req.error
    return {
        rid: (list(r.output_ids), torch.stack(r.logits) if r.logits else None, r.exit_steps)
        for rid, r in reqs.items()
        if r.finish_reason != "abort"
    }


def _assert_same(eager: dict, graphs: dict) -> None:
    assert eager.keys() == graphs.keys()
    for rid, (tokens, logits, exits) in eager.items():
        got_tokens, got_logits, got_exits = graphs[rid]
        assert got_tokens == tokens, f"{rid}: tokens differ"
        assert got_exits == exits, f"{rid}: exit loops differ"
        if logits is not None:
            assert torch.equal(got_logits, logits), (
                f"{rid}: logits differ by {(got_logits - logits).abs().max().item()}"
            )


def _requests(n: int, max_tokens: int = 6, seed: int = 0):
    """``n`` requests of different lengths, exits and sampling: greedy with logits, a fixed
    exit loop, a low threshold, a seeded sample (the packed-logits read-back)."""
    kinds = [
        (SamplingParams(max_tokens=max_tokens, ignore_eos=True), True),
        (SamplingParams(max_tokens=max_tokens, ignore_eos=True, exit_at_step=1), True),
        (SamplingParams(max_tokens=max_tokens, ignore_eos=True, exit_threshold=0.3), False),
        (SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=7), False),
        (SamplingParams(max_tokens=max_tokens, ignore_eos=True), False),
    ]
    return [
        (f"r{i}", prompt_of(5 + 7 * i, seed=seed + i), *kinds[i % len(kinds)]) for i in range(n)
    ]


@pytest.mark.parametrize("mode", list(WITH_FIA))
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_replayed_decode_steps_give_the_tokens_and_logits_of_eager_steps(tiny_ckpt, mode, batch):
    requests = _requests(batch)
    eager = _run(_llm(tiny_ckpt, mode, False), requests)
    llm = _llm(tiny_ckpt, mode, True)
    assert llm.plan.attention == ("ascend_fia" if mode == "fast-fia" else "ascend_eager")
    graphs = _run(llm, requests)
    _assert_same(eager, graphs)
    stats = llm.engine.graphs.stats
    assert stats["graph_steps"] >= 4 and stats["captures"] >= 1, stats
    if batch == 5:  # more requests than max_num_seqs: admission in waves, eager prefill between
        assert stats["eager_steps"] >= 2


@pytest.mark.parametrize("mode", list(MODES))
def test_replay_equals_eager_across_preemption(tiny_ckpt, mode):
    requests = [
        (f"p{i}", prompt_of(20, seed=i), SamplingParams(max_tokens=30, ignore_eos=True), True)
        for i in range(3)
    ]  # two run at once in 6 blocks, and each grows to 4: the newest is preempted
    eager_llm = _llm(tiny_ckpt, mode, False, num_blocks=6)
    eager = _run(eager_llm, requests)
    llm = _llm(tiny_ckpt, mode, True, num_blocks=6)
    graphs = _run(llm, requests)
    assert llm.engine.stats["preemptions"] == eager_llm.engine.stats["preemptions"] > 0
    _assert_same(eager, graphs)
    assert llm.engine.graphs.stats["graph_steps"] > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_replay_equals_eager_with_prefix_cache_hits(tiny_ckpt, mode):
    shared = prompt_of(2 * BS + 3, seed=11)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    requests = [(f"s{i}", shared + prompt_of(4 + i, seed=20 + i), params, True) for i in range(3)]
    results = []
    for graphs in (False, True):
        llm = _llm(tiny_ckpt, mode, graphs, enable_prefix_caching=True)
        first = _run(llm, requests[:1])  # fills the cache, then two requests hit it
        rest = _run(llm, requests[1:])
        assert llm.engine.stats["prefix_cache_hits"] >= 2 * 2 * BS
        results.append({**first, **rest})
    _assert_same(*results)


@pytest.mark.parametrize("mode", list(WITH_FIA))
def test_replay_equals_eager_when_requests_are_aborted_midway(tiny_ckpt, mode):
    requests = _requests(4, max_tokens=8, seed=3)
    abort = {3: "r1", 6: "r3"}  # one while decoding, one later: the batch shrinks twice
    eager = _run(_llm(tiny_ckpt, mode, False), requests, abort)
    graphs = _run(_llm(tiny_ckpt, mode, True), requests, abort)
    assert set(eager) == {"r0", "r2"}
    _assert_same(eager, graphs)


def test_padding_rows_write_only_the_scratch_page(tiny_ckpt):
    """Three requests padded to four rows: every KV slot but the scratch page's holds the
    eager engine's bits, and the eager engine never touched that page."""
    requests = _requests(3)
    caches = []
    for graphs in (False, True):
        llm = _llm(tiny_ckpt, "deterministic", graphs, num_blocks=24 if graphs else 25)
        if not graphs:
            assert llm.allocator.reserve(1) == [0]  # the graphs' page ids
        else:
            assert llm.engine.graphs.scratch == [0] and 4 in llm.engine.graphs.sizes[0]
        _run(llm, requests)
        caches.append((llm.kv_store.key_cache.clone(), llm.kv_store.value_cache.clone()))
    (k_eager, v_eager), (k_graph, v_graph) = caches
    assert torch.equal(k_eager[:, BS:], k_graph[:, BS:])
    assert torch.equal(v_eager[:, BS:], v_graph[:, BS:])
    assert not k_eager[:, :BS].any() and k_graph[:, :BS].any()


def test_engines_on_one_pool_share_the_graphs_scratch_and_count_it_once(tiny_ckpt):
    """An LLM and its variants (bench speculative builds three) hold one reservation, as large
    as the largest need; each engine counts the pool without all of it. (Each once took its
    own scratch, and a request the engine had admitted waited forever for pages.)"""
    llm = _llm(tiny_ckpt, "fast", True)  # 4 rows: padding fits 1 block
    spec = llm.with_speculation(1, 3)  # 4 generated + 4 draft + 16 verify rows: 2 blocks
    plain = llm.with_speculation(None)
    engines = [x.engine for x in (llm, spec, plain)]
    assert all(e.graphs is not None for e in engines)
    assert engines[0].graphs.scratch == engines[2].graphs.scratch == engines[1].graphs.scratch[:1]
    assert len(llm.allocator.reserved) == 2 and llm.allocator.num_free == 25 - 2
    assert {e.pool_tokens for e in engines} == {23 * BS}
    out = spec.generate([prompt_of(20, seed=1)], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6 and spec.engine.graphs.stats["graph_steps"]


def test_a_request_the_pool_can_no_longer_hold_ends_with_an_error_instead_of_waiting(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=BS, num_blocks=4)
    engine = llm.engine
    engine.add_request("r", prompt_of(40, seed=1), SamplingParams(max_tokens=4))  # 3 blocks
    llm.allocator.reserve(2)  # after validation: another engine on the pool reserved pages
    outputs = [out for _ in range(2) for out in engine.step()]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r", "error")]
    assert "needs 3 KV block(s) to start, but the pool has 2 free" in outputs[0].error
    assert not engine.has_unfinished() and engine.stats["failed"] == 1


def test_an_input_copied_into_a_new_tensor_is_caught_by_the_double(tiny_ckpt, monkeypatch):
    """The planted bug: a step's ids copied into a fresh tensor that the step then reads. The
    emulated graph refuses the read of a buffer its capture never saw."""
    llm = _llm(tiny_ckpt, "hf-exact", True)
    real_load = graph_buffers.StaticBuffers.load

    def load_into_a_new_tensor(self, values, host):
        real_load(self, values, host)
        self.view["ids"] = self.view["ids"].clone()  # the bug

    monkeypatch.setattr(graph_buffers.StaticBuffers, "load", load_into_a_new_tensor)
    with pytest.raises(RuntimeError, match="a buffer the capture never read"):
        llm.generate([prompt_of(9)], SamplingParams(max_tokens=4, ignore_eos=True))


def test_an_input_copied_beside_the_static_buffer_gives_stale_tokens(tiny_ckpt, monkeypatch):
    """The same bug where the step keeps reading the static buffer (as a real graph would):
    the replay computes the previous step's inputs again, and the tokens differ from eager."""
    requests = _requests(2, max_tokens=6)
    eager = _run(_llm(tiny_ckpt, "deterministic", False), requests)

    def load_beside(self, values, host):
        self.host.numpy()[:] = values
        self.device = self.host.clone()  # the bug: the graph's buffer keeps the old step

    llm = _llm(tiny_ckpt, "deterministic", True)
    monkeypatch.setattr(graph_buffers.StaticBuffers, "load", load_beside)
    graphs = _run(llm, requests)
    with pytest.raises(AssertionError, match="tokens differ|logits differ"):
        _assert_same(eager, graphs)


def test_graphs_are_admitted_at_start_up_by_a_replay_equal_to_the_eager_step(tiny_ckpt):
    llm = _llm(tiny_ckpt, "hf-exact", True)
    (verdict,) = [a for a in llm.plan.admissions if a.op == "step_graphs"]
    assert verdict.admitted and verdict.kernel == "npu_graph (emulated)"
    assert "replay equals the eager step bit for bit" in verdict.why
    assert llm.engine.graphs is not None and llm.engine.graphs.stats["captures"] == 1


_real_static_inputs = engine_graphs.static_inputs


def _diverging_exits(model, buf, early):  # the planted bug: the static step reads every
    step = _real_static_inputs(model, buf, early)  # row's logits from the last loop
    last = step.exits.step * 0 + model.cfg.total_ut_steps - 1
    rule = attrs.evolve(step.exits, step=last, use_threshold=step.exits.use_threshold * 0)
    return attrs.evolve(step, exits=rule)


def _stale_load(self, values, host):  # the planted bug: the step's data copied beside it
    self.host.numpy()[:] = values
    self.device = self.host.clone()


@pytest.mark.parametrize(
    "planted, why",
    [
        ((engine_graphs, "static_inputs", _diverging_exits), "exit loops"),
        (
            (graph_buffers.StaticBuffers, "load", _stale_load),
            "differs from the eager step in its logits",
        ),  # noqa: E501
    ],
    ids=["static-step-differs", "stale-static-buffer"],
)
def test_a_graph_whose_replay_differs_from_eager_is_refused_and_steps_run_eagerly(
    tiny_ckpt, monkeypatch, planted, why
):
    requests = _requests(3)
    eager = _run(_llm(tiny_ckpt, "deterministic", False), requests)
    monkeypatch.setattr(*planted)
    llm = _llm(tiny_ckpt, "deterministic", True)
    (verdict,) = [a for a in llm.plan.admissions if a.op == "step_graphs"]
    assert not verdict.admitted and why in verdict.why, verdict.why
    assert llm.engine.graphs is None and llm.allocator.num_free == 25  # the scratch page back
    _assert_same(eager, _run(llm, requests))


def test_mode_fast_captures_decode_steps_by_default_where_the_driver_can(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="npu", block_size=128, num_blocks=9, mode="fast")
    assert llm.engine.graphs is not None
    assert any(a.op == "step_graphs" and a.admitted for a in llm.plan.admissions)
    off = LLM(tiny_ckpt, device="npu", block_size=128, num_blocks=8, mode="fast",
              step_graphs=False)  # fmt: skip
    assert off.engine.graphs is None
    cpu = LLM(tiny_ckpt, device="cpu", block_size=BS, num_blocks=8, mode="fast")
    assert cpu.engine.graphs is None
    assert any("step graphs off: driver 'cpu' offers no step graphs" in n for n in cpu.plan.notes)
    adaptive = LLM(tiny_ckpt, device="npu", block_size=128, num_blocks=8, mode="fast",
                   adaptive_depth=True)  # fmt: skip
    assert adaptive.engine.graphs is None
    assert any("--adaptive-depth" in n for n in adaptive.plan.notes)


def test_step_graphs_are_refused_where_they_cannot_run(tiny_ckpt):
    with pytest.raises(ValueError, match="driver 'cpu' offers no step graphs"):
        LLM(tiny_ckpt, device="cpu", block_size=BS, num_blocks=8, step_graphs=True)
    with pytest.raises(ValueError, match="cannot be combined with --adaptive-depth"):
        _llm(tiny_ckpt, "deterministic", True, adaptive_depth=True)


# -- the emulated NPUGraph itself -----------------------------------------------------------


@pytest.fixture
def npu():
    return EmulatedTorchNpu()


def test_the_double_writes_each_replay_into_the_outputs_of_its_capture(npu):
    x = torch.arange(4.0)
    graph = npu.NPUGraph()
    out = graph.capture(lambda: x * 2 + 1)
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    graph.replay()
    assert out.tolist() == [21.0, 41.0, 61.0, 81.0] and graph.num_ops == 2


def test_the_double_catches_control_flow_that_a_graph_would_freeze(npu):
    x = torch.ones(4)
    calls = [0]

    def step():  # a branch on host state that changes between steps
        calls[0] += 1
        return x * 2 if calls[0] == 1 else x + 2

    graph = npu.NPUGraph()
    graph.capture(step)
    with pytest.raises(GraphReplayError, match="op 0: captured aten.mul.Tensor, replayed aten.add"):
        graph.replay()
    rows = [3]
    graph = npu.NPUGraph()
    graph.capture(lambda: x[: rows[0]] * 2)  # a shape from host data
    rows[0] = 2
    with pytest.raises(GraphReplayError, match="other shapes or host arguments"):
        graph.replay()


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: bool(t.sum() > 0),
        lambda t: t.cpu(),
        lambda t: t.numpy(),
        lambda t: t + torch.tensor([1.0, 2.0]),
    ],
    ids=["item", "tolist", "bool", "cpu", "numpy", "torch.tensor"],
)
def test_a_host_read_during_capture_raises(npu, read):
    x = torch.ones(2)
    with pytest.raises(GraphCaptureError, match="during graph capture"):
        npu.NPUGraph().capture(lambda: read(x * 3))
    with pytest.raises(GraphCaptureError, match="during graph capture"), npu.graph(npu.NPUGraph()):
        read(x * 3)


def test_synchronising_or_copying_to_the_host_during_capture_raises(npu):
    x = torch.ones(2)
    with pytest.raises(GraphCaptureError, match="synchronize during graph capture"):
        npu.NPUGraph().capture(lambda: (x * 2, npu.synchronize()))
    with pytest.raises(GraphCaptureError, match="device-to-host copy during graph capture"):
        npu.NPUGraph().capture(lambda: npu.to_host(x * 2))


def test_an_emulated_npu_op_is_one_device_op_whose_own_checks_are_no_host_reads(npu):
    cache = torch.zeros(8, 2, dtype=torch.bfloat16)
    slots = torch.tensor([[1], [5]])
    rows = torch.ones(2, 2, dtype=torch.bfloat16)
    graph = npu.NPUGraph()
    graph.capture(lambda: npu.npu_scatter_nd_update_(cache, slots, rows * 2))
    assert graph.num_ops == 2  # the mul and the one ScatterND, not the checks it runs
    rows.fill_(3)
    graph.replay()
    assert cache[5].tolist() == [6.0, 6.0] and not cache[0].any()


def test_host_arguments_are_frozen_at_capture_and_only_update_refreshes_them():
    """``_npu_paged_attention``'s ``context_lens`` (argument 7) is a host list. A graph captured
    plainly replays the captured one whatever the step passes; one captured with
    ``auto_dispatch_capture=True`` cannot replay until ``update(cpu_update_input=...)`` gives
    it the step's (on hardware it would wait for the update's event)."""

    def paged(q, *args):  # a stand-in op: the sum of its first context_lens[0] elements
        return q[: args[6][0]].sum(0, keepdim=True)

    op = _npu_op("_npu_paged_attention", paged)
    q, lens = torch.arange(6.0), [2]
    graph = EmulatedTorchNpu().NPUGraph()
    out = graph.capture(lambda: op(q, 0, 0, 0, 0, 0, 0, list(lens)))
    lens[0] = 4
    graph.replay()
    assert out.tolist() == [1.0]  # the captured context_lens, not the callable's new one
    with pytest.raises(RuntimeError, match="does not support update"):
        graph.update([{"context_lens": [4]}])

    graph = EmulatedTorchNpu().NPUGraph()
    out = graph.capture(lambda: op(q, 0, 0, 0, 0, 0, 0, list(lens)), auto_dispatch_capture=True)
    with pytest.raises(GraphReplayError, match="without update"):
        graph.replay()
    graph.update([{"context_lens": [3]}])
    graph.replay()
    assert out.tolist() == [3.0]
    with pytest.raises(GraphReplayError, match="without update"):
        graph.replay()  # every replay needs its own update
    with pytest.raises(RuntimeError, match="there are 1 operators"):
        graph.update([{"context_lens": [1]}, {"context_lens": [2]}])
