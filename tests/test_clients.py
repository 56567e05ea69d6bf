"""Real clients against a real server on loopback: LangChain's ChatOpenAI, guidellm's default
streaming benchmark and lm-evaluation-harness's local-completions with batched prompts.

They come with the ``clients`` extra, in a venv of their own (``make test-clients`` builds
``.venv-clients``); where they are not installed these tests skip and say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _needs(module: str):
    """Skip (before any fixture starts a server) where ``module`` is not installed."""
    return pytest.mark.skipif(
        find_spec(module) is None, reason=f"needs the clients extra ({module}): make test-clients"
    )


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64)


def _chat_greedy(local, messages: list[dict], n: int) -> str:
    text = local.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = local.tokenizer.encode(text, add_special_tokens=False)
    return local.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].text


@_needs("langchain_openai")
def test_langchain_chat_openai_invokes_and_streams_with_usage(server, local):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="toy",
        base_url=server.base + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=6,
        max_retries=0,
        stream_usage=True,
        extra_body={"ignore_eos": True},
    )
    said = llm.invoke([SystemMessage("be brief"), HumanMessage("hi")])
    want = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert said.content == _chat_greedy(local, want, 6)
    assert said.usage_metadata["output_tokens"] == 6
    chunks = list(llm.stream([HumanMessage("hi")]))
    assert "".join(c.content for c in chunks) == _chat_greedy(local, want[1:], 6)
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.usage_metadata["output_tokens"] == 6
    # A tool round trip in LangChain's own shapes: assistant tool_calls (content null), tool.
    call = {"name": "f", "args": {"x": 1}, "id": "call_1"}
    turns = [
        HumanMessage("f(1)?"),
        AIMessage(content="", tool_calls=[call]),
        ToolMessage(content="42", tool_call_id="call_1"),
    ]
    assert llm.invoke(turns).usage_metadata["output_tokens"] == 6


@_needs("guidellm")
def test_guidellm_default_streaming_benchmark_completes_with_figures(server, tiny_ckpt, tmp_path):
    report = tmp_path / "guidellm.json"
    cmd = [
        *(sys.executable, "-m", "guidellm", "run"),
        *("--backend", f"kind=openai_http,target={server.base},model=toy"),
        *("--tokenizer", f"kind=huggingface_auto,model={tiny_ckpt}"),
        *("--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4"),
        *("--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16"),
        *("--output", f"kind=json,path={report}", "--disable-console"),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=OFFLINE, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    requests = bench["requests"]
    assert len(requests["successful"]) == 4 and requests["errored"] == []
    for r in requests["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream_options"]["continuous_usage_stats"]  # what it sends by default
        assert isinstance(body["messages"][0]["content"], list)  # content parts
        counted = httpx.post(server.base + "/tokenize", json={"messages": body["messages"]})
        assert r["prompt_tokens"] == counted.json()["count"]  # from the server's usage
        assert r["output_tokens"] == 16 and r["time_to_first_token_ms"] > 0


def _lm_eval_task(folder: Path, local) -> None:
    """A generate_until task whose answers are what offline greedy decoding says: its score is
    1.0 exactly when every batched completion equals the offline one."""
    rows = []
    for i in range(5):
        question = f"count {i} {i + 1} {i + 2}"
        ids = local.tokenizer.encode(question, add_special_tokens=False)
        stop = ("\n", local.tokenizer.eos_token)  # lm-eval adds the eos string to `until`
        out = local.generate([ids], SamplingParams(max_tokens=8, stop=stop))[0].text
        rows.append({"question": question, "answer": out.split("\n")[0]})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "rlt_hal_greedy",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / "rlt_hal_greedy.yaml").write_text(json.dumps(task))  # JSON is YAML


@_needs("lm_eval")
def test_lm_eval_local_completions_batches_prompts_through_the_remote_tokenizer(
    server, local, tmp_path
):
    _lm_eval_task(tmp_path, local)
    cmd = [
        *(sys.executable, "-m", "lm_eval", "--model", "local-completions"),
        *("--model_args", f"model=toy,base_url={server.base}/v1/completions,max_retries=1"),
        *("--tasks", "rlt_hal_greedy", "--include_path", str(tmp_path)),
        *("--batch_size", "2", "--output_path", str(tmp_path / "out")),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=OFFLINE, capture_output=True, text=True)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, log
    assert "Auto-detected remote tokenizer support" in done.stderr  # /tokenizer_info, /tokenize
    (results,) = (tmp_path / "out").rglob("results_*.json")
    score = json.loads(results.read_text())["results"]["rlt_hal_greedy"]["exact_match,none"]
    assert score == 1.0, log
