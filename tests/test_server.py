"""The OpenAI-compatible server, through a real process and the official openai client."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.server_helpers import ServerProcess

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64)


def _greedy(local, prompt, n=8):
    return local.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]


def _wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m["rlt_hal_running_requests"] == 0
            and m["rlt_hal_waiting_requests"] == 0
            and m["rlt_hal_kv_free_blocks"] == m["rlt_hal_kv_total_blocks"]
        ):
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle: {server.metrics()}")


def test_a_greedy_completion_equals_llm_generate_with_exact_usage(client, local):
    want = _greedy(local, PROMPT)
    got = client.completions.create(
        model="toy", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 8
    assert got.usage.total_tokens == got.usage.prompt_tokens + 8


def test_a_token_id_prompt_is_accepted(client, local):
    want = _greedy(local, [5, 6, 7, 8])
    got = client.completions.create(
        model="toy",
        prompt=[5, 6, 7, 8],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == 4


def test_streamed_completion_text_adds_up_and_ends_with_usage(client, local):
    want = _greedy(local, PROMPT)
    chunks = list(
        client.completions.create(
            model="toy",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_uses_the_chat_template_streamed_or_not(client, local):
    messages = [{"role": "user", "content": "hi there"}]
    ids = local.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = _greedy(local, local.tokenizer.encode(ids, add_special_tokens=False))
    whole = client.chat.completions.create(
        model="toy", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model="toy",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_health_and_openapi_are_served(server, client):
    assert [m.id for m in client.models.list().data] == ["toy"]
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    spec = httpx.get(server.base + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


def _post(server, path, body, raw=None):
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(
        server.base + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )


GOOD = {"model": "toy", "prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize(
    "body, raw, status, param, message",
    [
        (None, "{not json", 400, None, "not valid JSON"),
        ({**GOOD, "max_tokens": "many"}, None, 400, "max_tokens", "valid integer"),
        ({**GOOD, "temperature": -1}, None, 400, "temperature", "greater than or equal"),
        ({**GOOD, "frobnicate": 1}, None, 400, "frobnicate", "unknown field 'frobnicate'"),
        ({**GOOD, "model": "gpt-4"}, None, 404, "model", "'gpt-4' does not exist"),
        ({**GOOD, "max_tokens": 5000}, None, 400, "max_tokens", "holds 1024 tokens"),
        ({**GOOD, "n": 0}, None, 400, "n", "greater than or equal to 1"),
        ({**GOOD, "best_of": 2}, None, 400, "best_of", "best_of > 1 is not supported"),
        ({**GOOD, "logprobs": 30}, None, 400, "logprobs", "less than or equal to 20"),
        ({**GOOD, "prompt": [99999]}, None, 400, "prompt", "must be in [0, 1024)"),
        ({**GOOD, "prompt": ""}, None, 400, "prompt", "the prompt is empty"),
        ({"model": "toy"}, None, 400, "prompt", "Field required"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server, body, raw, status, param, message
):
    r = _post(server, "/v1/completions", body, raw)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"] and err["param"] == param
    assert _post(server, "/v1/completions", GOOD).status_code == 200


def test_eight_concurrent_streaming_clients_all_get_their_own_text(server, client, local):
    prompts = [f"prompt number {i}" for i in range(8)]
    want = {p: _greedy(local, p, 6).text for p in prompts}
    errors, results = [], []

    def worker(prompt):
        try:
            for _ in range(3):
                stream = client.completions.create(
                    model="toy",
                    prompt=prompt,
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                results.append((prompt, "".join(c.choices[0].text for c in stream)))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(results) == 24
    assert all(text == want[p] for p, text in results)
    _wait_idle(server)


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(server):
    before = server.metrics()['rlt_hal_requests_total{status="abort"}']
    body = {**GOOD, "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    m = _wait_idle(server)
    assert m['rlt_hal_requests_total{status="abort"}'] == before + 1


def test_metrics_count_requests_tokens_and_latencies(server, client):
    before = server.metrics()
    client.completions.create(
        model="toy", prompt="count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    assert after["rlt_hal_generated_tokens_total"] >= before["rlt_hal_generated_tokens_total"] + 3
    assert (
        after["rlt_hal_time_to_first_token_seconds_count"]
        > before["rlt_hal_time_to_first_token_seconds_count"]
    )
    assert (
        after["rlt_hal_time_per_output_token_seconds_count"]
        > before["rlt_hal_time_per_output_token_seconds_count"]
    )


def test_metrics_are_in_the_prometheus_text_format_with_process_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="toy", prompt="scrape", max_tokens=2)
    r = httpx.get(server.base + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    kinds = {
        "rlt_hal_requests": "counter",
        "rlt_hal_generated_tokens": "counter",
        "rlt_hal_prompt_tokens": "counter",
        "rlt_hal_running_requests": "gauge",
        "rlt_hal_kv_free_blocks": "gauge",
        "rlt_hal_kv_total_blocks": "gauge",
        "rlt_hal_kv_cached_blocks": "gauge",
        "rlt_hal_prefix_cache_queries": "counter",
        "rlt_hal_prefix_cache_hits": "counter",
        "rlt_hal_preemptions": "counter",
        "rlt_hal_time_to_first_token_seconds": "histogram",
        "rlt_hal_time_per_output_token_seconds": "histogram",
        "process_resident_memory_bytes": "gauge",
        "python_info": "gauge",
    }
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    states = {s.labels["status"] for s in families["rlt_hal_requests"].samples}
    assert {"stop", "length", "abort", "error"} <= states
    total = next(s for s in families["rlt_hal_kv_total_blocks"].samples)
    assert total.value == 64


BIG = 9 * 1024 * 1024  # over the 8 MiB default


def test_a_body_over_the_size_limit_gets_an_openai_413_and_the_server_keeps_serving(server):
    def post(content):
        url, json_type = server.base + "/v1/completions", {"content-type": "application/json"}
        return httpx.post(url, content=content, headers=json_type, timeout=30)

    def chunked(data: bytes, size: int = 1 << 20):  # no Content-Length: the server counts
        for i in range(0, len(data), size):
            yield data[i : i + size]

    big = json.dumps({**GOOD, "prompt": "x" * BIG}).encode()
    for r in (post(big), post(chunked(big))):
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "exceeds 8388608 bytes" in err["message"]
    assert post(chunked(json.dumps(GOOD).encode(), size=10)).status_code == 200
    assert _post(server, "/v1/completions", GOOD).status_code == 200


def test_exit_fields_choose_the_loop_and_exit_steps_come_back_only_when_asked(server, client):
    extra = {"ignore_eos": True, "exit_at_step": 1}
    plain = client.completions.create(
        model="toy", prompt=PROMPT, max_tokens=5, temperature=0, extra_body=extra
    )
    assert "exit_steps" not in plain.choices[0].model_extra
    asked = client.completions.create(
        model="toy",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={**extra, "return_exit_steps": True},
    )
    assert asked.choices[0].model_extra["exit_steps"] == [1] * 5
    assert asked.choices[0].text == plain.choices[0].text
    chunks = list(
        client.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True, "exit_threshold": 0.5, "return_exit_steps": True},
        )
    )
    steps = [s for c in chunks if c.choices for s in c.choices[0].model_extra.get("exit_steps", [])]
    assert len(steps) == 5 and all(0 <= s < 4 for s in steps)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("exit_at_step", 4, "exit_at_step must be in [0, 4)"),
        ("exit_at_step", -1, "greater than or equal to 0"),
        ("exit_threshold", 1.5, "less than or equal to 1"),
        ("exit_threshold", 0, "greater than 0"),
    ],
)
def test_out_of_range_exit_fields_are_a_400_naming_the_field(server, field, value, message):
    r = _post(server, "/v1/completions", {**GOOD, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and message in err["message"]


def test_metrics_count_the_exit_loop_of_every_generated_token(server, client):
    before = server.metrics()["rlt_hal_exit_step_count"]
    client.completions.create(
        model="toy",
        prompt="depth",
        max_tokens=4,
        extra_body={"ignore_eos": True, "exit_at_step": 2},
    )
    after = server.metrics()
    assert after["rlt_hal_exit_step_count"] == before + 4
    assert after['rlt_hal_exit_step_bucket{le="1.0"}'] < after['rlt_hal_exit_step_bucket{le="2.0"}']


def test_an_api_key_is_required_when_configured(tiny_ckpt):
    proc = ServerProcess(tiny_ckpt, "--api-key", "s3cret")
    try:
        for headers, status in (
            ({}, 401),
            ({"authorization": "Bearer wrong"}, 401),
            ({"authorization": "Bearer s3cret"}, 200),
        ):
            r = httpx.post(proc.base + "/v1/completions", json=GOOD, headers=headers)
            assert r.status_code == status
            if status == 401:
                assert r.json()["error"]["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=proc.base + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="toy", prompt="hi", max_tokens=1).usage
    finally:
        proc.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tiny_ckpt):
    proc = ServerProcess(tiny_ckpt)
    result = {}

    def request():
        r = httpx.post(
            proc.base + "/v1/completions",
            timeout=60,
            json={**GOOD, "max_tokens": 40, "ignore_eos": True},
        )
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=request)
    t.start()
    time.sleep(0.5)
    assert proc.stop(signal.SIGTERM) == 0
    t.join(30)
    assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 40


def test_a_dead_engine_loop_fails_requests_and_health_with_503(tiny_ckpt):
    """What a lost device does to the loop thread, injected (no device can be lost here): the
    request in flight, later requests and /health all get a 503 at once, streams included."""
    import uvicorn

    from runtime_glue.server.app import Server, build_app
    from tests.server_helpers import free_port

    local = LLM(tiny_ckpt, block_size=16, num_blocks=64)  # its own: this one is left broken
    server = Server(local, "toy")
    stepped = threading.Event()
    real_step = local.engine.step

    def step_then_lose_the_device():
        if stepped.is_set():
            raise RuntimeError("device lost")
        stepped.set()
        return real_step()

    local.engine.step = step_then_lose_the_device
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(build_app(server), port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not http.started and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {**GOOD, "max_tokens": 8, "ignore_eos": True}
        first = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 503
        error = first.json()["error"]
        assert error["code"] == "engine_failed" and "RuntimeError: device lost" in error["message"]
        assert httpx.post(base + "/v1/completions", json=body, timeout=5).status_code == 503
        assert httpx.get(base + "/health", timeout=5).status_code == 503
        with httpx.stream(
            "POST", base + "/v1/completions", json={**body, "stream": True}, timeout=5
        ) as stream:
            assert stream.status_code == 503
        registry = server.loop.metrics.registry
        assert registry.get_sample_value("rlt_hal_requests_total", {"status": "error"}) == 1
    finally:
        http.should_exit = True
        thread.join(30)
