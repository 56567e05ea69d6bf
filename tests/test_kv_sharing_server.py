"""A real server under ``--kv-sharing last`` (loopback port, the official openai client): a
pool too small for four concurrent 200-token generations with full KV serves them at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import GREEDY, prompt_of
from tests.server_helpers import ServerProcess

BLOCKS, MAX_TOKENS = 24, 200
PROMPTS = [prompt_of(12, seed=s) for s in range(4)]
# Full KV: each request needs ceil((12 + 199) / 16) = 14 blocks of 16, 56 for four: the pool of
# 24 cannot hold them. Shared: 1 prompt block + 13 generated blocks (4 to a block) each, 17.


def test_full_kv_cannot_serve_the_four_without_preemption(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=BLOCKS, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert llm.engine.stats["preemptions"] > 0


def test_a_sharing_server_serves_four_long_generations_at_once_without_preemption(tiny_ckpt):
    server = ServerProcess(
        tiny_ckpt, "--num-blocks", str(BLOCKS), "--max-num-seqs", "4", "--kv-sharing", "last"
    )
    try:
        assert "kv sharing last" in server.output()
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)

        def complete(prompt):
            return client.completions.create(
                model="toy",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

        running = 0
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, p) for p in PROMPTS]
            while not all(f.done() for f in futures):
                running = max(running, server.metrics()["rlt_hal_running_requests"])
                time.sleep(0.05)
            got = [f.result() for f in futures]
        assert running == 4, "the four should have run at once"
        assert [g.usage.completion_tokens for g in got] == [MAX_TOKENS] * 4
        metrics = server.metrics()
        assert metrics["rlt_hal_preemptions_total"] == 0
        assert metrics['rlt_hal_kv_blocks_in_use{kind="generated"}'] == 0  # all given back
        assert metrics["rlt_hal_kv_free_blocks"] == BLOCKS
        local = LLM(tiny_ckpt, block_size=16, num_blocks=64, kv_sharing="last")
        want = local.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
        assert [g.choices[0].text for g in got] == [w.text for w in want]
    finally:
        server.stop()
