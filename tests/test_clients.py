"""Real clients against a real server on loopback: LangChain's ChatOpenAI (logprobs, n,
structured output, tools), guidellm's default streaming benchmark and lm-evaluation-harness's
local-completions (batched prompts; multiple choice through echo and logprobs).

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
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.server_helpers import ServerProcess

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _needs(module: str):
    """Skip (before any fixture starts a server) where ``module`` is not installed."""
    return pytest.mark.skipif(
        find_spec(module) is None, reason=f"needs the clients extra ({module}): make test-clients"
    )


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64)


def _chat_prompt(local, messages: list[dict]) -> list[int]:
    text = local.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return local.tokenizer.encode(text, add_special_tokens=False)


def _chat_greedy(local, messages: list[dict], n: int) -> str:
    ids = _chat_prompt(local, messages)
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


@_needs("langchain_openai")
def test_langchain_logprobs_with_n_equal_the_offline_ones(server, local):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="toy", base_url=server.base + "/v1", api_key="unused", temperature=0,
        max_tokens=6, max_retries=0, logprobs=True, top_logprobs=2, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    (generations,) = llm.generate([[HumanMessage("hi")]]).generations
    assert len(generations) == 2
    ids = _chat_prompt(local, [{"role": "user", "content": "hi"}])
    want = local.generate([ids], SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True))[0]
    for gen in generations:  # greedy: both choices are the offline answer
        assert gen.text == want.text
        content = gen.generation_info["logprobs"]["content"]
        assert [e["logprob"] for e in content] == [
            row[t].logprob for t, row in zip(want.token_ids, want.logprobs, strict=True)
        ]
        assert all(len(e["top_logprobs"]) == 2 for e in content)
    said = llm.invoke([HumanMessage("hi")])
    assert len(said.response_metadata["logprobs"]["content"]) == 6


class Pet(BaseModel):
    """A pet (bounded fields: a random model always finishes it)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=8)


class GetWeather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


def _chat_openai(server, seed: int):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="toy", base_url=server.base + "/v1", api_key="unused", max_tokens=300,
        max_retries=0, seed=seed,
    )  # fmt: skip


@_needs("langchain_openai")
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_succeeds_every_time(default_server, method):
    # json_mode asks for any JSON object, which bounds nothing: a random model may not close it
    for seed in range(4):
        llm = _chat_openai(default_server, seed)
        pet = llm.with_structured_output(Pet, method=method).invoke("describe a pet")
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


@_needs("langchain_openai")
@pytest.mark.parametrize("tool_choice", ["required", "GetWeather"])
def test_langchain_bind_tools_gets_a_valid_call_every_time(default_server, tool_choice):
    from langchain_core.messages import HumanMessage, ToolMessage

    for seed in range(4):
        llm = _chat_openai(default_server, seed).bind_tools(
            [GetWeather], tool_choice=tool_choice, parallel_tool_calls=False
        )
        said = llm.invoke([HumanMessage("weather in Oslo?")])
        (call,) = said.tool_calls
        assert call["name"] == "GetWeather" and call["id"].startswith("call_")
        GetWeather(**call["args"])
        assert said.response_metadata["finish_reason"] == "tool_calls"
        turns = [HumanMessage("weather?"), said, ToolMessage("sunny", tool_call_id=call["id"])]
        assert (
            _chat_openai(default_server, seed).bind(max_tokens=3).invoke(turns).content is not None
        )


def _mc_task(folder: Path) -> None:
    """A multiple-choice task of local text (no dataset hub): lm-eval scores each choice by
    its continuation's loglikelihood, through echo and logprobs."""
    rows = [
        ("The quick brown fox jumps over the lazy", ["dog", "cat", "fox"], 0),
        ("Numbers: 0 1 2 3 4 5 6 7 8", ["9", "nine", "ten"], 0),
        ("Pack my box with five dozen liquor", ["jugs", "bottles"], 0),
        ("An inference server accepts requests over", ["HTTP", "carrier pigeon"], 0),
        ("def main():\n    print(", ['"hello, world")', "42)"], 0),
    ]
    data = folder / "mc.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "gold": g}) + "\n" for q, c, g in rows)
    )
    task = {
        "task": "rlt_hal_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / "rlt_hal_mc.yaml").write_text(json.dumps(task))


def _offline_loglikelihood(local, context: str, continuation: str) -> float:
    """What lm-eval computes from the server's echoed logprobs, offline: its pair encoding
    (the whole text, split at the context's length), then the continuation tokens'
    log-probabilities summed in order."""
    encode = lambda text: local.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    out = local.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    return sum(out.prompt_logprobs[p][whole[p]].logprob for p in range(len(ctx), len(whole)))


@pytest.fixture(scope="module")
def depth_server(tiny_ckpt):
    """Served with depth-wise batching and adaptive depth: a decode token may leave after any
    loop, but a prompt row (what a loglikelihood scores) runs every loop."""
    proc = ServerProcess(
        tiny_ckpt, "--depth-batching", "--adaptive-depth", "--exit-threshold", "0.5"
    )
    yield proc
    proc.stop()


@_needs("lm_eval")
@pytest.mark.parametrize("served, batch_size", [("server", 1), ("server", 2), ("depth_server", 2)])
def test_lm_eval_multiple_choice_scores_with_the_offline_loglikelihoods(
    request, served, local, tmp_path, batch_size
):
    """The loglikelihoods lm-eval reports are the offline ones bit for bit; with depth-wise
    batching and adaptive depth too, where they are those of the same exit threshold with
    every loop run (multiple choice scores prompt rows, which never leave early)."""
    server = request.getfixturevalue(served)
    if served == "depth_server":
        local = LLM(local.model_dir, block_size=16, num_blocks=64, exit_threshold=0.5)
    _mc_task(tmp_path)
    cmd = [
        *(sys.executable, "-m", "lm_eval", "--model", "local-completions"),
        *("--model_args", f"model=toy,base_url={server.base}/v1/completions,max_retries=1"),
        *("--tasks", "rlt_hal_mc", "--include_path", str(tmp_path), "--log_samples"),
        *("--batch_size", str(batch_size), "--output_path", str(tmp_path / "out")),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=OFFLINE, capture_output=True, text=True)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, log
    (results,) = (tmp_path / "out").rglob("results_*.json")
    score = json.loads(results.read_text())["results"]["rlt_hal_mc"]["acc,none"]
    assert 0.0 <= score <= 1.0
    (samples,) = (tmp_path / "out").rglob("samples_rlt_hal_mc_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(docs) == 5
    for doc in docs:
        for args, (reported, _greedy) in zip(
            doc["arguments"].values(), doc["filtered_resps"], strict=True
        ):
            want = _offline_loglikelihood(local, args["arg_0"], args["arg_1"])
            assert float(reported) == want, (args, reported, want)  # bit for bit


# -- the Responses API: LangChain's use_responses_api and the OpenAI Agents SDK ---------------


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A Thinking-layout toy served with deepseek_r1's reasoning parser."""
    from runtime_glue.cli.main import main as cli

    out = tmp_path_factory.mktemp("thinking") / "ckpt"
    assert cli(["toy-checkpoint", str(out), "--thinking"]) == 0
    proc = ServerProcess(out, "--reasoning-parser", "deepseek_r1")
    yield proc
    proc.stop()


@_needs("langchain_openai")
def test_langchain_over_the_responses_api_reads_the_reasoning_and_makes_a_tool_call(
    thinking_server, default_server
):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    # A budget ends the random weights' reasoning; a grammar makes them write a word after it.
    think = {"thinking_token_budget": 5, "structured_outputs": {"regex": "[a-z]{2,6}"},
             "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    llm = ChatOpenAI(model="toy", base_url=thinking_server.base + "/v1", api_key="unused",
                     temperature=0, max_tokens=24, max_retries=0, use_responses_api=True,
                     extra_body=think)  # fmt: skip
    said = llm.invoke([HumanMessage("What is 2 + 2?")])
    blocks = {b["type"]: b for b in said.content}
    (thought,) = blocks["reasoning"]["content"]
    chat = httpx.post(thinking_server.base + "/v1/chat/completions", json={
        "model": "toy", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "temperature": 0, "max_tokens": 24, **think}).json()["choices"][0]["message"]  # fmt: skip
    assert thought["text"] == chat["reasoning"] and blocks["text"]["text"] == chat["content"]
    assert said.usage_metadata["output_token_details"]["reasoning"] == 6  # 5 and the end tag

    tools = ChatOpenAI(model="toy", base_url=default_server.base + "/v1", api_key="unused",
                       max_tokens=300, max_retries=0, temperature=0, use_responses_api=True)  # fmt: skip
    bound = tools.bind_tools([GetWeather], tool_choice="GetWeather")
    (call,) = bound.invoke([HumanMessage("weather in Oslo?")]).tool_calls
    assert call["name"] == "GetWeather"
    GetWeather(**call["args"])


@_needs("agents")
def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool_to_completion(tool_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    asked = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    class Verdict(BaseModel):  # the answer's schema, so that random weights finish it
        sky: Literal["sunny", "rainy"]

    client = AsyncOpenAI(base_url=tool_server.base + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the tool's help.",
        tools=[get_weather],
        output_type=Verdict,
        model=OpenAIResponsesModel(model="toy", openai_client=client),
        # the first turn must call the tool; the SDK then resets tool_choice and the model answers
        model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
    )
    result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert isinstance(result.final_output, Verdict)
    assert asked and asked[0] in ("Oslo", "Paris")
    assert result.new_items[1].output == f"sunny in {asked[0]}"
