"""What the gateway checks in a request body (the shared rules of
``workers/openai_rules.py``: ``stream_options``, the parameters no worker
implements; and its own output-token cap, ``gateway/params.py``); first
as tables of cases, then through a gateway in this process in front of a
raw worker that keeps the bodies it is sent; and ``GET /v1/models/{model}``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import uvloop

from controlplane.gateway.params import apply_output_cap, output_cap
from tests.controlplane.gateway.raw import KEY, answering, gateway_before, reply, worker
from workers.openai_error import ApiError
from workers.openai_rules import check_request

OK = reply(
    200,
    b'{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " ok", '
    b'"finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}',
)


# ---- the checks, pure -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": True, "stream_options": "x"}, "stream_options"),
        ({"stream": True, "stream_options": [1]}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"suffix": " and then"}, "suffix"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"logit_bias": "x"}, "logit_bias"),
        ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2**70}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
    ],
)
def test_a_body_the_gateway_refuses_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        check_request(body, chat=False)
    assert (raised.value.status, raised.value.param) == (400, param)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"stream": True, "stream_options": {"include_usage": False}},
        {"stream": True, "stream_options": {}},
        {"stream": True, "stream_options": None},
        {"best_of": 1, "suffix": "", "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
        {"best_of": None, "suffix": None, "tools": None, "response_format": None},
    ],
)
def test_the_neutral_value_of_each_checked_parameter_is_accepted(body: dict[str, Any]) -> None:
    check_request(body, chat=False)


@pytest.mark.parametrize(
    ("body", "chat", "cap", "after"),
    [
        # No cap: nothing changes, whatever is asked (the workers' default holds).
        ({}, True, None, {}),
        ({"max_tokens": 10_000}, False, None, {"max_tokens": 10_000}),
        # No limit asked: the cap is written in (a completion's default of 16 only when the cap is below it).
        ({}, True, 64, {"max_completion_tokens": 64}),
        ({}, False, 8, {"max_tokens": 8}),
        ({}, False, 64, {}),
        # Within the cap: left alone.
        ({"max_tokens": 64}, False, 64, {"max_tokens": 64}),
        ({"max_completion_tokens": 10, "max_tokens": 999}, True, 64, {"max_completion_tokens": 10, "max_tokens": 999}),
        # Not a whole number: the worker's to refuse.
        ({"max_tokens": "lots"}, False, 64, {"max_tokens": "lots"}),
    ],
)
def test_the_output_cap_fills_in_a_missing_limit_and_leaves_the_rest(
    body: dict[str, Any], chat: bool, cap: int | None, after: dict[str, Any]
) -> None:
    apply_output_cap(body, chat, cap)
    assert body == after


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"max_tokens": 65}, False, "max_tokens"),
        ({"max_tokens": 65}, True, "max_tokens"),
        ({"max_completion_tokens": 65, "max_tokens": 1}, True, "max_completion_tokens"),
        ({"max_tokens": 1e9}, False, "max_tokens"),
        ({"max_tokens": 10**400}, False, "max_tokens"),  # no float form: it must not be formatted as one
    ],
)
def test_asking_for_more_than_the_cap_is_refused_naming_the_field(body: dict[str, Any], chat: bool, param: str) -> None:
    with pytest.raises(ApiError) as raised:
        apply_output_cap(body, chat, 64)
    assert raised.value.param == param and "64" in raised.value.message


def test_the_tightest_cap_that_is_set_holds() -> None:
    assert output_cap(None, None) is None
    assert output_cap(100, None) == output_cap(None, 100) == 100
    assert output_cap(100, 40) == output_cap(40, 100) == 40


# ---- through the gateway -------------------------------------------------------------------
def send(path: str, bodies: list[dict[str, Any] | bytes], **gateway: Any) -> tuple[list[httpx.Response], list[bytes]]:
    """Each body through a gateway before one raw worker; the responses and
    the bodies the worker was sent."""
    seen: list[bytes] = []

    async def test() -> list[httpx.Response]:
        async with worker(answering(OK, seen)) as (url, _), gateway_before([url], **gateway) as (port, _):
            async with httpx.AsyncClient(timeout=10) as client:
                return [
                    await client.post(
                        f"http://127.0.0.1:{port}{path}",
                        headers={"authorization": f"Bearer {KEY}"},
                        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                    )
                    for body in bodies
                ]

    return uvloop.run(test()), seen  # type: ignore[arg-type]


def test_malformed_stream_options_are_a_400_naming_the_field_never_a_500() -> None:
    """``"x"`` and ``[1]`` were a TypeError in the gateway (500); ``{"include_usage": "y"}`` was sent on as true."""
    bodies: list[dict[str, Any] | bytes] = [
        {"model": "m", "prompt": "hi", "stream": True, "stream_options": options}
        for options in ("x", [1], {"include_usage": "y"})
    ]
    responses, seen = send("/v1/completions", bodies)
    assert [r.status_code for r in responses] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in responses] == [
        "stream_options",
        "stream_options",
        "stream_options.include_usage",
    ]
    assert seen == []  # no worker was bothered


def test_parameters_no_worker_implements_are_refused_not_ignored() -> None:
    responses, seen = send(
        "/v1/chat/completions",
        [
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], name: value}
            for name, value in (
                ("tools", [{"type": "function", "function": {"name": "f"}}]),
                ("response_format", {"type": "json_object"}),
            )
        ],
    )
    responses += send(
        "/v1/completions", [{"model": "m", "prompt": "hi", "best_of": 3}, {"model": "m", "prompt": "hi", "suffix": "!"}]
    )[0]
    assert [(r.status_code, r.json()["error"]["param"]) for r in responses] == [
        (400, "tools"),
        (400, "response_format"),
        (400, "best_of"),
        (400, "suffix"),
    ]
    assert all(r.json()["error"]["type"] == "invalid_request_error" for r in responses)
    assert seen == []


def test_poisoned_logit_bias_and_min_tokens_are_400s_naming_the_field_before_any_worker() -> None:
    base = {"model": "m", "prompt": "hi", "max_tokens": 4}
    bodies: list[dict[str, Any] | bytes] = [
        {**base, "logit_bias": "x"},
        b'{"model": "m", "prompt": "hi", "logit_bias": {"1": NaN}}',
        {**base, "min_tokens": -1},
        {**base, "min_tokens": 2**70},
        {**base, "min_tokens": 5},  # above max_tokens
    ]
    responses, seen = send("/v1/completions", bodies)
    assert [(r.status_code, r.json()["error"]["param"]) for r in responses] == [
        (400, "logit_bias"),
        (400, "logit_bias"),
        (400, "min_tokens"),
        (400, "min_tokens"),
        (400, "min_tokens"),
    ]
    assert seen == []
    responses, seen = send("/v1/completions", [{**base, "min_tokens": 4, "logit_bias": {"7": -100}}])
    assert responses[0].status_code == 200 and json.loads(seen[0])["logit_bias"] == {"7": -100}


def test_a_request_without_a_cap_reaches_the_worker_byte_for_byte() -> None:
    raw = '{"model": "m", "prompt": "a\\ud800b caf\u00e9", "max_tokens": 5000}'.encode()
    responses, seen = send("/v1/completions", [raw])
    assert responses[0].status_code == 200 and seen == [raw]


def test_the_smaller_of_the_keys_and_the_models_cap_holds_and_fills_in_a_missing_limit() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}
    responses, seen = send(
        "/v1/chat/completions",
        [chat, {**chat, "max_tokens": 51}, {**chat, "max_tokens": 50}, {**chat, "stream": True}],
        key_cap=50,
        table_cap=200,
    )
    assert [r.status_code for r in responses] == [200, 400, 200, 200]
    assert responses[1].json()["error"]["param"] == "max_tokens" and "50" in responses[1].json()["error"]["message"]
    sent = [json.loads(body) for body in seen]
    assert sent[0]["max_completion_tokens"] == 50 and sent[0]["messages"] == chat["messages"]  # the surrogate kept
    assert sent[1] == {**chat, "max_tokens": 50}
    # A stream gets the cap and the gateway's usage option in one rewrite.
    assert sent[2]["max_completion_tokens"] == 50 and sent[2]["stream_options"] == {"include_usage": True}
    responses, _ = send("/v1/completions", [{"model": "m", "prompt": "hi", "max_tokens": 150}], table_cap=100)
    assert responses[0].status_code == 400 and "100" in responses[0].json()["error"]["message"]


def test_one_model_is_served_at_v1_models_id_as_openai_does() -> None:
    async def test() -> tuple[Any, Any, list[httpx.Response]]:
        async with (
            worker(answering(OK)) as (url, _),
            gateway_before([url], model="org/tiny", table_cap=64) as (port, _),
        ):
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
            card = await client.models.retrieve("org/tiny")
            try:
                await client.models.retrieve("nope")
            except openai.NotFoundError as exc:
                missing = exc
            async with httpx.AsyncClient(timeout=10) as raw:
                plain = [
                    await raw.get(
                        f"http://127.0.0.1:{port}/v1/models/nope", headers={"authorization": f"Bearer {KEY}"}
                    ),
                    await raw.get(f"http://127.0.0.1:{port}/v1/models/org/tiny"),
                ]
            return card, missing, plain

    card, missing, (not_found, no_key) = uvloop.run(test())
    assert (card.id, card.object, card.owned_by) == ("org/tiny", "model", "chunkpilot")
    assert card.model_extra["max_output_tokens"] == 64  # the route's cap, visible to clients
    assert missing.status_code == 404
    assert not_found.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert no_key.status_code == 401
