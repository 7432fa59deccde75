"""The one OpenAI error type (``workers/openai_error.py``): its reply body, and
a worker's error body read back by the gateway."""

from __future__ import annotations

import json

from workers.openai_error import MAX_MESSAGE_CHARS, ApiError, bad


def test_the_body_is_openais_shape_and_encodes_to_the_same_json() -> None:
    error = ApiError("busy", status=429, type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    assert error.body() == {
        "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }
    assert json.loads(error.encode()) == error.body()
    assert (bad("no", param="n").status, bad("no", param="n").param) == (400, "n")


def test_a_workers_error_reply_reads_back_with_every_field() -> None:
    sent = ApiError("`min_tokens` must be an integer.", param="min_tokens", code="x")
    said = ApiError.from_reply(400, sent.encode())
    assert (said.status, said.message, said.type, said.param, said.code) == (
        400,
        sent.message,
        "invalid_request_error",
        "min_tokens",
        "x",
    )


def test_a_reply_not_in_openais_shape_keeps_its_text() -> None:
    said = ApiError.from_reply(502, b"<html>Bad Gateway</html>" + b"x" * 1000)
    assert said.status == 502 and said.message.startswith("<html>Bad Gateway") and said.code is None
    assert len(said.message) == MAX_MESSAGE_CHARS
    assert ApiError.from_reply(500, b'{"error": "plain"}').message == "plain"
    assert ApiError.from_reply(500, b'{"error": {"message": 5, "code": 7}}').code is None
