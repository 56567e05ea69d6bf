"""A bounded fuzz of the HTTP API from its own OpenAPI spec: no 5xx, no hang, still serving."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def schemas(server):
    spec = httpx.get(server.base + "/openapi.json").json()
    comps = spec["components"]["schemas"]
    return {
        "/v1/completions": comps["CompletionRequest"],
        "/v1/chat/completions": comps["ChatCompletionRequest"],
        "/tokenize": comps["TokenizeRequest"],
        "/detokenize": comps["DetokenizeRequest"],
    }


VALID = {
    "/v1/completions": {"model": "toy", "prompt": "fuzz", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "toy",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "fuzz"}],
    },
    "/tokenize": {"model": "toy", "messages": [{"role": "user", "content": "fuzz"}]},
    "/detokenize": {"model": "toy", "tokens": [5, 6]},
}


@st.composite
def bodies(draw, schemas):
    path = draw(st.sampled_from(sorted(schemas)))
    fields = sorted(schemas[path]["properties"]) + ["unknown_field"]
    body = dict(VALID[path]) if draw(st.booleans()) else {}
    for name in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        body[name] = draw(json_values)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4  # keep valid requests short: this is about validation
    body.pop("stream", None) if draw(st.booleans()) else None
    return path, body


def test_fuzzed_requests_never_get_a_5xx_and_the_server_keeps_serving(server, schemas):
    @settings(
        max_examples=120,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(case=bodies(schemas))
    def check(case):
        path, body = case
        r = httpx.post(server.base + path, json=body, timeout=30)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert (
        httpx.post(
            server.base + "/v1/completions", json=VALID["/v1/completions"], timeout=30
        ).status_code
        == 200
    )
