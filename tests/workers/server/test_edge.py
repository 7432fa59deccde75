"""The worker's edge against hostile or careless input, on a real ``serve``
process: bodies past the limit fail fast with 413 (even one that is only
declared), bad sampling parameters and lone surrogates are 400s naming the
field, a checkpoint without a chat template gives a 400 saying so, and none
of it touches the worker's health. Ends with a property-based fuzz of the
sampling parameters (hypothesis) straight at the worker: never a 5xx, and
/health stays 200."""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import wait_until
from tests.workers.server.support import worker

MAX_REQUEST_BYTES = 64 * 1024
PROFILE = {"max_num_batched_tokens": 128, "max_num_seqs": 4, "block_size": 16, "kv_cache_bytes": 8 << 20}


@pytest.fixture(scope="module")
def no_template_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its chat template taken out."""
    out = tmp_path_factory.mktemp("no-template") / "tiny-no-template"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def served(no_template_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("edge-worker") / "worker.log"
    extra = ["--max-model-len", "512", "--max-request-bytes", str(MAX_REQUEST_BYTES), "--served-model-name", "tiny"]
    with worker(no_template_model, log, profile=json.dumps(PROFILE), extra=extra) as (url, _):
        yield url, log


@pytest.fixture(scope="module")
def server(served: tuple[str, Path]) -> str:
    return served[0]


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=30).status_code == 200


def raw_request(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (+ ``body``) on a raw socket and read the reply back: its
    head and as much body as its Content-Length says (the server may write the
    two apart, and keeps the connection open a moment after, as nginx does)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head + body)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
            top, sep, rest = reply.partition(b"\r\n\r\n")
            if sep:
                length = next(
                    (
                        int(v)
                        for k, _, v in (line.partition(b":") for line in top.split(b"\r\n")[1:])
                        if k.strip().lower() == b"content-length"
                    ),
                    0,
                )
                if len(rest) >= length:
                    break
        return reply


def test_a_body_declared_larger_than_the_limit_is_413_before_it_is_sent(server: str) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
        b"Content-Length: 20000000\r\n\r\n"
    )
    reply = raw_request(server, head)  # not one byte of the 20 MB follows
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"request_too_large" in reply


def whole_reply(url: str, data: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Send ``data`` on a raw socket; the reply's status line, headers and body, read to the server's close."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(data)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, dict(line.lower().split(b": ", 1) for line in lines), body


@pytest.mark.parametrize(
    "data",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: w\r\nno colon here\r\n\r\n",
        b"GET /health?q=" + b"a" * 210_000 + b" HTTP/1.1\r\nHost: w\r\n\r\n",
    ],
    ids=["request-line", "header", "url-over-200kb"],
)
def test_what_the_http_parser_refuses_is_a_400_in_openais_json_shape(server: str, data: bytes) -> None:
    status, headers, body = whole_reply(server, data)
    assert status.startswith(b"HTTP/1.1 400"), status
    assert headers[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert (set(error), error["type"], error["code"]) == (
        {"message", "type", "param", "code"},
        "invalid_request_error",
        "invalid_http",
    )
    assert healthy(server)


def test_a_chunked_body_past_the_limit_is_413(server: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 4096
        yield b'"}'

    response = httpx.post(f"{server}/v1/completions", content=chunks(), timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert healthy(server)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "a", "max_tokens": 2, "temperature": NaN}', "temperature"),
        ('{"prompt": "a", "max_tokens": 2, "seed": 1180591620717411303424}', "seed"),
        ('{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ],
)
def test_the_issues_poisoned_requests_are_400s_and_the_worker_stays_healthy(server: str, body: str, param: str) -> None:
    response = httpx.post(
        f"{server}/v1/completions", content=body.encode(), headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert healthy(server)
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        # the issue's 100,000 levels, cut to what this worker's 64 KB body limit lets through
        b'{"prompt":"x","max_tokens":3,"user":' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        b'{"prompt":"x","max_tokens":3,"user":' + b"[" * 900 + b"]" * 900 + b"}",  # within json's own limit
        b'{"prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
    ],
    ids=["nested-30000-deep", "nested-900-deep", "integer-5000-digits"],
)
def test_bodies_past_the_parsers_limits_are_400s_and_the_worker_stays_healthy(server: str, body: bytes) -> None:
    response = httpx.post(
        f"{server}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"
    assert healthy(server)


def test_a_client_that_leaves_mid_body_is_one_log_line_not_a_traceback(served: tuple[str, Path]) -> None:
    server, log = served
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "'
        )
        time.sleep(0.3)  # the worker is reading the body when the client goes
    wait_until(lambda: "the client went away" in log.read_text(), timeout=30)
    text = log.read_text()
    assert "unhandled error" not in text and "Traceback" not in text
    assert healthy(server)


def test_a_tiny_temperature_is_served_not_fatal(server: str) -> None:
    for _ in range(2):
        response = httpx.post(
            f"{server}/v1/completions", json={"prompt": "a", "max_tokens": 4, "temperature": 1e-40}, timeout=60
        )
        assert response.status_code == 200, response.text
    assert healthy(server)


def test_chat_on_a_checkpoint_without_a_template_is_a_400_that_says_so(server: str) -> None:
    response = httpx.post(
        f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "no chat template" in error["message"]


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
anything_numeric = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.one_of(anything_numeric, st.floats(0, 2), st.sampled_from([1e-40, 5e-324, 0.0])),
        "top_p": st.one_of(anything_numeric, st.floats(0, 1)),
        "top_k": anything_numeric,
        "seed": anything_numeric,
        "max_tokens": st.one_of(st.integers(-2, 6), anything_numeric),
        "presence_penalty": anything_numeric,
        "frequency_penalty": anything_numeric,
        "repetition_penalty": anything_numeric,
        "min_p": anything_numeric,
        "logprobs": st.one_of(st.integers(-1, 2), anything_numeric),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=3), anything_numeric),
        "stop_token_ids": st.one_of(st.lists(st.integers(-(2**70), 2**70), max_size=3), anything_numeric),
        "ignore_eos": st.one_of(st.booleans(), anything_numeric),
        "n": st.one_of(st.integers(-1, 3), anything_numeric),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=12),
            st.lists(st.integers(-5, 5000), min_size=1, max_size=6),
            st.sampled_from(["a\ud800b", "\udfff"]),
        ),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=SAMPLING)
def test_fuzzed_sampling_parameters_never_give_a_5xx_and_the_worker_stays_healthy(server: str, params: dict) -> None:
    body = {"prompt": "def f(x):", "max_tokens": 3, **params}
    # allow_nan: JSON's NaN and Infinity, which Python's json (and the worker) read as floats.
    raw = json.dumps(body, allow_nan=True, ensure_ascii=True).encode()
    response = httpx.post(
        f"{server}/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code < 500, (body, response.text)
    assert response.status_code in (200, 400), (body, response.text)
    if response.status_code == 400:
        assert response.json()["error"]["param"], (body, response.text)
    assert healthy(server)
