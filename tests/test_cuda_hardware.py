"""Real CUDA GPU: run with ``pytest --run-cuda`` (and ``--pyargs hal.testing --rlt-driver
cuda`` for the kit). Results are recorded in docs/cuda.md when a GPU was available."""

from __future__ import annotations

import pytest
import torch

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.config import OuroConfig
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of
from tests.reference.ouro_hf import OuroReference

pytestmark = pytest.mark.cuda


def test_the_cuda_driver_initialises_with_event_fences():
    from drivers.cuda.driver import create

    driver = create(index=0)
    driver.device.initialize()
    fence = driver.device.record_fence()
    fence.wait()
    assert fence.done() and driver.device.torch_device.type == "cuda"


@pytest.mark.parametrize("name", ["gqa-h64-d32-L2-T4", "wide-h2048-d128-L1-T4"])
def test_cuda_eager_matches_the_hf_reference_on_the_same_gpu(checkpoints, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    ref = OuroReference(OuroConfig.from_dir(ckpt)).load(ckpt).to("cuda")
    prompt = prompt_of(20, seed=2)
    want_tokens, want_logits = ref.generate(prompt, 16)
    llm = LLM(ckpt, device="cuda", attention_backend="cuda_eager", block_size=16, num_blocks=8)
    got = llm.generate(
        [prompt], SamplingParams(max_tokens=16, ignore_eos=True), return_logits=True
    )[0]
    assert list(got.token_ids) == want_tokens
    assert torch.equal(got.logits, want_logits)


def test_cuda_sdpa_stays_close_to_cuda_eager(checkpoints):
    name = "wide-h2048-d128-L1-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = [
        LLM(ckpt, device="cuda", attention_backend=b, block_size=16, num_blocks=8).generate(
            [prompt_of(20, seed=2)], params, return_logits=True
        )[0]
        for b in ("cuda_eager", "cuda_sdpa")
    ]
    assert (outs[0].logits[0] - outs[1].logits[0]).abs().max() < 0.5


def _graph_llms(ckpt, **options):
    common = dict(device="cuda", attention_backend="cuda_eager", block_size=16, **options)
    return LLM(ckpt, num_blocks=16, **common), LLM(ckpt, num_blocks=17, step_graphs=True, **common)


@pytest.mark.parametrize("deterministic", [False, True], ids=["hf-exact", "deterministic"])
def test_cuda_step_graphs_replay_what_the_static_step_computes_eagerly(checkpoints, deterministic):
    """On the GPU a CUDAGraph replay runs the kernels its capture chose: the same bits as
    ``OuroModel.forward`` over the same static buffers run eagerly."""
    from runtime_glue.engine.graph_buffers import static_inputs
    from runtime_glue.engine.graphs import packed_of, picks_of

    name = "wide-gqa-h2048-d128-L2-T2"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    _, llm = _graph_llms(ckpt, deterministic=deterministic, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate([prompt_of(20, seed=s) for s in range(3)], params)
    runner = llm.engine.graphs
    assert runner.stats["graph_steps"] >= 4, runner.stats
    for graph, buf, (logits, chosen, _, _, picks, packed) in runner._graphs.values():
        graph.replay()
        with torch.inference_mode():
            eager = llm.model.forward(static_inputs(llm.model, buf, None))
        assert torch.equal(logits, eager.logits) and torch.equal(chosen, eager.chosen)
        assert torch.equal(picks, picks_of(eager)) and torch.equal(packed, packed_of(eager))


def test_cuda_step_graphs_keep_the_eager_engines_tokens(checkpoints):
    """Against the eager engine the bits may differ (cuBLAS picks kernels by shape, and the
    graph's attention runs padded shapes); the greedy tokens must not, and the logits stay
    within 0.05 of each other (bf16 logits of a random wide checkpoint)."""
    name = "wide-gqa-h2048-d128-L2-T2"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(20 + 9 * s, seed=s) for s in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager, graphs = (llm.generate(prompts, params, return_logits=True) for llm in _graph_llms(ckpt))
    for a, b in zip(eager, graphs, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.logits - b.logits).abs().max() < 0.05


def test_cuda_depth_steps_replayed_keep_the_eager_depth_steps_tokens(checkpoints):
    """Depth-wise steps replayed one after another (most sample no row, so nothing is read
    back between them: each must have copied its inputs before the next overwrites the pinned
    staging buffer), alone and batched, with and without exits: the eager depth steps' tokens
    and exit loops."""
    name = "gqa-h64-d32-L2-T4"
    ckpt = checkpoints(name, **PARITY_CONFIGS[name])
    prompts = [prompt_of(9 + 5 * s, seed=s) for s in range(3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for extra in ({}, dict(adaptive_depth=True, exit_threshold=0.5)):
        base = dict(device="cuda", attention_backend="cuda_eager", block_size=16,
                    deterministic=True, depth_batching=True, **extra)  # fmt: skip
        eager = LLM(ckpt, num_blocks=64, step_graphs=False, **base)
        graphs = LLM(ckpt, num_blocks=65, step_graphs=True, **base)  # one for padding rows
        for batch in (prompts[:1], prompts):
            want = eager.generate(batch, params)
            got = graphs.generate(batch, params)
            for a, b in zip(want, got, strict=True):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids, extra
                assert a.outputs[0].exit_steps == b.outputs[0].exit_steps, extra
        assert graphs.engine.graphs is not None and graphs.engine.graphs.stats["graph_steps"] > 0
