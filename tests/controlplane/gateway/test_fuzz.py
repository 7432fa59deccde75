"""A bounded property-based fuzz of the gateway's OpenAI endpoints: bodies
built by hypothesis from OpenAI's parameter names with values of every JSON
type (NaN, 2**70, 10**400 and lone surrogates included), sent to a gateway in
this process before a raw worker that answers each request it is handed.
Whatever comes, the gateway answers with a status below 500 and, when it
refuses, an OpenAI error object; and it goes on serving."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.controlplane.gateway.raw import (
    HEAD,
    KEY,
    chunk,
    gateway_before,
    read_request,
    reply,
    worker,
)

EVENT = b'data: {"choices":[{"index":0,"text":" hi","finish_reason":"length"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
OK = reply(
    200,
    b'{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " ok", '
    b'"finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}',
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "suffix",
    "tools",
    "tool_choice",
    "response_format",
    "temperature",
    "top_p",
    "seed",
    "user",
    "stop",
    "logprobs",
    "echo",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.just(10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.just("a\ud800b"),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["include_usage", "type", "role", "content", "x"]), inner, max_size=3)
    ),
    max_leaves=8,
)
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "m", "m", "other"])},
    optional={name: values for name in FIELDS if name != "model"},
)


async def _answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A worker that answers every request it is handed: a stream when asked for one."""
    while True:
        body = json.loads(await read_request(reader))
        if body.get("stream") is True:
            writer.write(HEAD + chunk(EVENT + USAGE + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            writer.write(OK)
        await writer.drain()


@pytest.fixture(scope="module")
def client(gateway_port: int) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"http://127.0.0.1:{gateway_port}", headers={"authorization": f"Bearer {KEY}"}, timeout=10
    ) as c:
        yield c


@pytest.fixture(scope="module")
def gateway_port() -> Iterator[int]:
    """One gateway (output cap 100 on its key) and one worker on a loop of their own thread."""
    ready: list[int] = []
    started = threading.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []
    stop_box: list[asyncio.Event] = []

    async def main() -> None:
        stop = asyncio.Event()
        loop_box.append(asyncio.get_running_loop())
        stop_box.append(stop)
        async with worker(_answers) as (url, _), gateway_before([url], key_cap=100) as (port, _):
            ready.append(port)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: uvloop.run(main()), daemon=True)
    thread.start()
    assert started.wait(30), "the gateway did not start"
    try:
        yield ready[0]
    finally:
        loop_box[0].call_soon_threadsafe(stop_box[0].set)
        thread.join(30)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=bodies, chat=st.booleans())
def test_no_body_makes_the_gateway_answer_5xx(client: httpx.Client, body: dict[str, Any], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and set(error) == {"message", "type", "param", "code"}


NESTED = b'{"model":"m","prompt":"x","max_tokens":3,"user":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE_INTEGER = b'{"model":"m","prompt":"x","max_tokens":' + b"9" * 5000 + b"}"


@pytest.mark.parametrize("body", [NESTED, HUGE_INTEGER], ids=["nested-100000-deep", "integer-5000-digits"])
def test_bodies_past_the_parsers_limits_are_400s_in_openai_shape(client: httpx.Client, body: bytes) -> None:
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"


def test_the_gateway_still_serves_after_the_fuzz(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " ok"
