"""The stream meter: what passes to the client, and what it measures. Pure."""

from __future__ import annotations

import json

import pytest

from controlplane.gateway.meter import StreamMeter


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def text(t: str, finish: str | None = None) -> bytes:
    return event({"object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": finish}]})


def delta(d: dict) -> bytes:
    return event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]})


USAGE = event(
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 3,
            "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
)
DONE = b"data: [DONE]\n\n"


def test_times_first_token_gaps_and_tpot_from_content_events() -> None:
    meter = StreamMeter(arrival=10.0)
    assert meter.feed(text("a"), 10.2) == text("a")
    meter.feed(text("b"), 10.3)
    meter.feed(text("c", "length"), 10.9)
    meter.feed(USAGE + DONE, 10.9)
    assert meter.ttft_seconds == pytest.approx(0.2)
    assert meter.gap_seconds == pytest.approx(0.6)
    assert meter.output_tokens == 3
    assert meter.tpot_seconds == pytest.approx(0.35)
    assert (meter.usage.prompt_tokens, meter.usage.cached_tokens) == (11, 8)
    assert meter.done


def test_a_chat_role_only_first_chunk_is_not_the_first_token() -> None:
    meter = StreamMeter(arrival=0.0)
    meter.feed(delta({"role": "assistant", "content": ""}), 0.1)
    meter.feed(delta({"content": "Hi"}), 0.5)
    assert meter.ttft_seconds == pytest.approx(0.5)


def test_events_split_across_reads_are_held_until_whole_and_nothing_else_is() -> None:
    meter = StreamMeter(arrival=0.0)
    whole = text("a") + text("b")
    cut = len(text("a")) + 5
    assert meter.feed(whole[:cut], 1.0) == text("a")
    assert meter.feed(whole[cut:], 2.0) == text("b")
    assert meter.num_token_events == 2


def test_usage_the_gateway_asked_for_is_dropped_but_the_clients_own_is_kept() -> None:
    ours = StreamMeter(arrival=0.0, strip_usage=True)
    assert ours.feed(text("a") + USAGE + DONE, 1.0) == text("a") + DONE
    assert ours.usage is not None and ours.output_tokens == 3
    theirs = StreamMeter(arrival=0.0)
    assert theirs.feed(text("a") + USAGE + DONE, 1.0) == text("a") + USAGE + DONE


def test_an_error_event_is_passed_on_and_remembered() -> None:
    meter = StreamMeter(arrival=0.0)
    error = event({"error": {"message": "engine died", "type": "internal"}})
    assert meter.feed(error, 1.0) == error
    assert meter.upstream_error == "engine died"


def test_output_tokens_are_counted_when_no_usage_comes() -> None:
    meter = StreamMeter(arrival=0.0)
    for i in range(4):
        meter.feed(text(str(i)), float(i))
    assert meter.output_tokens == 4 and meter.usage is None


def test_non_sse_bytes_are_passed_through_once_too_many_are_held() -> None:
    meter = StreamMeter(arrival=0.0)
    blob = b"x" * (1 << 17)
    assert meter.feed(blob, 0.0) == blob


@pytest.mark.parametrize(
    ("payload", "is_token"),
    [
        ({"choices": [{"index": 0, "text": 'say "text":"x" and "error": no', "finish_reason": None}]}, True),
        ({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None}, False),
        ({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}, False),
        ({"choices": [{"index": 0, "delta": {"content": '"quoted"'}}]}, True),
        ({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}, True),
        ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}, True),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, False),
        ({"choices": [{"index": 0, "text": "a"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, True),
    ],
)
def test_token_events_are_recognised_without_being_fooled_by_the_text(payload: dict, is_token: bool) -> None:
    meter = StreamMeter(arrival=0.0)
    meter.feed(event(payload), 1.0)
    assert meter.num_token_events == int(is_token)
    assert meter.upstream_error is None
    if "usage" in payload and payload["usage"]:
        assert meter.usage is not None and meter.usage.prompt_tokens == 3


def test_whitespace_and_crlf_variants_of_events_are_read() -> None:
    meter = StreamMeter(arrival=0.0)
    meter.feed(b'data:{"choices":[{"text": "a"}]}\n\n', 1.0)
    meter.feed(b"data:  [DONE]\n\n", 2.0)
    assert meter.num_token_events == 1 and meter.done
