"""The engine: batching and chunked prefill parity, isolation, lifecycle, pool and fences.

Batch and chunk parity: each driver runs in its default mode. In deterministic mode (cpu's
default) a request's tokens and logits equal those it gets alone, bit for bit. In HF-exact mode
(npu's default) a kernel may round a row differently depending on the other rows of its call:
final-loop logits may differ by at most LOGIT_TOLERANCE while the tokens fed are the same, and
the tokens may part only where the batched run picked a token within LOGIT_TOLERANCE of the
best (a near-tie). Measured on a 2-core EPYC with avx512_bf16 (2026-12-03): logits within
0.19; one prompt of five parted at an exact tie (two logits of 11.625) on the hidden-2048
config. On an AVX2-only EPYC earlier: within 0.227, no parting. On a 2-core Xeon with AVX-512
but no avx512_bf16 (2026-12-05): within 0.625 (five bf16 ulps of a logit of 16, on the
emulated npu's first decode row of a 40-token prompt, random weights), two prompts of five
parted at near-ties. A request reading another's KV or a wrong mask moves logits by whole
units and parts tokens away from ties.
"""

from __future__ import annotations

import pytest
import torch

from hal.interfaces import Fence
from runtime_glue.checks.parity import within_tolerance
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.conftest import PARITY_CONFIGS
from tests.helpers import GREEDY, prompt_of, request_slots

LOGIT_TOLERANCE = 1.0
ENGINE_CONFIGS = ["gqa-h64-d32-L2-T4", "gqa-h256-d32-L3-T4", "wide-h2048-d128-L1-T4"]
PARAMS = SamplingParams(max_tokens=12, **GREEDY)


def _alone(ckpt, driver_name, prompts, params=PARAMS, **kw):
    llm = LLM(ckpt, device=driver_name, block_size=16, num_blocks=32, **kw)
    return [llm.generate([p], params, return_logits=True)[0] for p in prompts]


_ALONE: dict = {}


def _alone_once(ckpt, driver_name, prompts):
    """``_alone`` computed once per checkpoint, driver and prompts (the chunk sizes' reference)."""
    key = (str(ckpt), driver_name, tuple(map(tuple, prompts)))
    if key not in _ALONE:
        _ALONE[key] = _alone(ckpt, driver_name, prompts)
    return _ALONE[key]


def _skip_if_determinism_covers(driver_name: str, name: str) -> None:
    """At Ouro-1.4B's width the cpu driver runs deterministic mode, where
    tests/test_deterministic.py checks the same promise bit for bit (every chunk size, 7 among
    them; requests joining and leaving a batch) on this config and the other wide one: here it
    would be the same check again, at a minute of the suite's time."""
    if driver_name == "cpu" and name.startswith("wide"):
        pytest.skip("cpu at hidden 2048: test_deterministic.py checks these bits")


def _assert_same(got, want, mode: str):
    """``got`` (batched or chunked) against ``want`` (each alone), as ``mode`` promises."""
    for g, w in zip(got, want, strict=True):
        if mode == "deterministic":
            assert g.token_ids == w.token_ids and torch.equal(g.logits, w.logits)
            continue
        check = within_tolerance(w.token_ids, w.logits, g.token_ids, g.logits, LOGIT_TOLERANCE)
        assert check.passed, check


@pytest.mark.parametrize("name", ENGINE_CONFIGS)
def test_prompts_generated_together_match_each_generated_alone(checkpoints, driver_name, name):
    _skip_if_determinism_covers(driver_name, name)
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 33, 9, 40)]
    llm = LLM(ckpt, device=driver_name, block_size=16, num_blocks=32)
    together = llm.generate(prompts, PARAMS, return_logits=True)
    _assert_same(together, _alone(ckpt, driver_name, prompts), llm.mode)
    assert llm.engine.num_free_blocks == 32


@pytest.mark.parametrize("chunk", [1, 7, 16, 128])
@pytest.mark.parametrize("name", ENGINE_CONFIGS)
def test_chunked_prefill_matches_full_prefill(checkpoints, driver_name, name, chunk):
    _skip_if_determinism_covers(driver_name, name)
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(37, seed=1), prompt_of(20, seed=2)]
    llm = LLM(ckpt, device=driver_name, block_size=16, num_blocks=32, prefill_chunk_size=chunk)
    got = llm.generate(prompts, PARAMS, return_logits=True)
    _assert_same(got, _alone_once(ckpt, driver_name, prompts), llm.mode)


def test_poisoning_one_requests_pages_mid_batch_leaves_the_others_untouched(tiny_ckpt, driver_name):
    prompts = [prompt_of(n, seed=n) for n in (7, 23, 12)]

    def run(poison: bool):
        llm = LLM(tiny_ckpt, device=driver_name, block_size=16, num_blocks=16)
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, PARAMS, return_logits=True)
        reqs = [eng.requests[f"r{i}"] for i in range(3)]
        eng.step()  # all three prefill together
        if poison:
            victim = request_slots(llm, reqs[1], len(reqs[1].blocks) * 16)
            llm.kv_store.key_cache[:, victim] = float("nan")
            llm.kv_store.value_cache[:, victim] = float("nan")
        while eng.has_unfinished():
            eng.step()
        return reqs

    clean, poisoned = run(False), run(True)
    for i in (0, 2):
        assert poisoned[i].output_ids == clean[i].output_ids
        assert torch.equal(torch.stack(poisoned[i].logits), torch.stack(clean[i].logits))
    assert torch.isnan(torch.stack(poisoned[1].logits[1:])).all()


def test_sixteen_concurrent_requests_all_finish_with_their_own_outputs(tiny_ckpt, driver_name):
    prompts = [prompt_of(3 + 5 * i, seed=100 + i) for i in range(16)]
    llm = LLM(
        tiny_ckpt,
        device=driver_name,
        block_size=16,
        num_blocks=64,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        prefill_chunk_size=24,
    )
    together = llm.generate(prompts, PARAMS, return_logits=True)
    _assert_same(together, _alone(tiny_ckpt, driver_name, prompts), llm.mode)
    assert llm.engine.num_free_blocks == 64


def test_a_full_pool_queues_requests_until_pages_come_back(tiny_ckpt):
    prompts = [prompt_of(30, seed=i) for i in range(3)]
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=3)  # 48 tokens: one request at a time
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, PARAMS)
    eng.step()
    assert [r.request_id for r in eng.running] == ["r0"] and len(eng.waiting) == 2
    outputs = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    want = _alone(tiny_ckpt, "cpu", prompts)
    assert [outputs[f"r{i}"] for i in range(3)] == [w.token_ids for w in want]
    assert eng.num_free_blocks == 3


def _engine(tiny_ckpt, **kw):
    return LLM(tiny_ckpt, block_size=16, num_blocks=8, **kw).engine


def test_abort_while_waiting_mid_prefill_and_mid_decode_frees_everything(tiny_ckpt):
    eng = _engine(tiny_ckpt, prefill_chunk_size=8, max_num_seqs=2)
    eng.add_request("decoding", prompt_of(20, seed=1), SamplingParams(max_tokens=20))
    for _ in range(3):  # 20 prompt tokens in chunks of 8, then the first output token
        eng.step()
    for rid in ("prefilling", "waiting"):
        eng.add_request(rid, prompt_of(20, seed=2), SamplingParams(max_tokens=20))
    eng.step()  # "prefilling" gets its first chunk; "waiting" is over max_num_seqs
    assert not eng.requests["decoding"].in_prefill and eng.requests["decoding"].output_ids
    assert eng.requests["prefilling"].in_prefill
    assert eng.requests["waiting"] in eng.waiting
    for rid in ("waiting", "prefilling", "decoding"):
        assert eng.abort_request(rid)
    assert not eng.has_unfinished() and eng.num_free_blocks == 8
    assert eng.abort_request("decoding") is False


def test_a_live_id_cannot_be_reused_but_an_ended_one_can(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request id 'x' is already live"):
        eng.add_request("x", [5, 6, 7])
    while eng.has_unfinished():
        eng.step()
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    assert eng.requests["x"].output_ids == []


class LateFence(Fence):
    """Test double for an asynchronous device's event: completes only when waited on."""

    def __init__(self):
        self.completed = False

    def done(self):
        return self.completed

    def wait(self):
        self.completed = True


class LateFenceDevice:
    """Wraps the CPU device; its fences stay incomplete until someone waits (an NPU stand-in)."""

    def __init__(self, inner):
        self.inner, self.fences = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def record_fence(self):
        self.fences.append(LateFence())
        return self.fences[-1]


def test_pages_return_only_after_the_fence_of_their_last_step_completes(tiny_ckpt):
    eng = _engine(tiny_ckpt)
    eng.device = LateFenceDevice(eng.device)
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    last = eng.device.fences[-1]
    assert eng.allocator.num_free == 7 and eng.allocator.num_pending == 1
    last.wait()
    assert eng.num_free_blocks == 8


def test_a_failed_step_fails_its_requests_frees_their_pages_and_the_engine_goes_on(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=8)
    eng, model = llm.engine, llm.model
    real_forward = model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    model.forward = broken
    eng.add_request("doomed", [5, 6, 7], PARAMS)
    [out] = eng.step()
    assert out.finished and out.finish_reason == "error" and "device lost" in out.error
    assert eng.num_free_blocks == 8 and eng.stats["failed"] == 1
    model.forward = real_forward
    assert llm.generate([[5, 6, 7]], PARAMS)[0].finish_reason == "length"


def test_the_kv_pool_reports_how_many_tokens_it_holds(tiny_ckpt, tiny_config):
    llm = LLM(tiny_ckpt, block_size=16, kv_cache_memory=1 << 20)
    per_token = 2 * tiny_config.num_planes * tiny_config.num_key_value_heads * 32 * 2
    blocks = (1 << 20) // (per_token * 16)
    assert llm.kv_layout.num_blocks == blocks
    assert f"{blocks} blocks x 16 tokens = {blocks * 16} tokens" in llm.kv_summary
    assert f"{per_token} bytes/token" in llm.kv_summary
