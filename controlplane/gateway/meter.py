"""What a client saw, measured as the stream passes through. Pure: no I/O.

The meter sits on an SSE stream from a worker. It hands back the complete
events to forward (holding back only an event's unfinished tail, never a
whole one) and times each event that carries generated text: the first is
the TTFT, the largest space between two is the request's stall, and their
spread over the tokens is the TPOT. Token counts come from the ``usage`` the
worker sends last; when the gateway asked for that usage on the client's
behalf, the usage-only event is dropped so the client's stream is exactly
what it asked for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

EVENT_END = b"\n\n"
# Gaps between token events kept per stream for the request's timeline
# chart (the largest is kept apart, whatever the count).
MAX_GAPS = 256
# An upstream that never ends an event (not SSE after all) is passed through
# once this much is held, rather than buffered without bound.
MAX_HELD_BYTES = 1 << 16
# Most events are one token: they are read by pattern, not parsed (parsing
# was 40% of the gateway's time per event). The patterns are safe against
# generated text: inside a JSON string every quote is escaped, so `"text":"`
# can only be a key and its value's start. Anything that might carry usage
# or an error goes through the JSON parser.
_NEEDS_PARSING = re.compile(rb'"usage":\s*\{|"error"\s*:')
_HAS_CONTENT = re.compile(rb'"(?:text|content|reasoning_content)":\s*"[^"]|"tool_calls":\s*\[\s*\{')


@dataclass
class Usage:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None

    @classmethod
    def parse(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(_count(usage.get("prompt_tokens")), _count(cached), _count(usage.get("completion_tokens")))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of_body(body: bytes) -> Usage | None:
    """Usage of a non-streamed reply."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return Usage.parse(data.get("usage")) if isinstance(data, dict) else None


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):  # completions
        return True
    delta = choice.get("delta")  # chat
    return isinstance(delta, dict) and bool(
        delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
    )


@dataclass(slots=True)
class StreamMeter:
    arrival: float  # clock reading when the request arrived
    strip_usage: bool = False  # the usage event was asked for by us, not the client
    first_token_at: float | None = None
    last_token_at: float | None = None
    max_gap_seconds: float = 0.0
    num_token_events: int = 0
    usage: Usage | None = None
    upstream_error: str | None = None  # an error event the worker sent mid-stream
    facts: Any = None  # the engine's per-request facts (``chunkpilot`` key of the usage event)
    done: bool = False
    gaps: list[float] = field(default_factory=list)  # the first MAX_GAPS gaps between token events
    _held: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Take bytes as they arrived; return the bytes to forward now."""
        data = self._held + chunk if self._held else chunk
        end = data.rfind(EVENT_END)
        if end < 0:
            if len(data) > MAX_HELD_BYTES:
                self._held = b""
                return data
            self._held = data
            return b""
        end += len(EVENT_END)
        complete, self._held = data[:end], data[end:]
        return self._events(complete, now)

    def flush(self) -> bytes:
        """Whatever is still held when the stream ends."""
        held, self._held = self._held, b""
        return held

    def _events(self, complete: bytes, now: float) -> bytes:
        if complete.count(EVENT_END) == 1:  # the common case: one event per read
            return complete if self._event(complete, now) else b""
        kept = [event + EVENT_END for event in complete.split(EVENT_END)[:-1] if self._event(event, now)]
        return b"".join(kept)

    def _event(self, event: bytes, now: float) -> bool:
        """Account for one event; False to drop it from the client's stream."""
        start = event.find(b"data:")
        if start < 0:
            return True  # comments, keep-alives, other fields
        payload = event[start + 5 :]
        if _NEEDS_PARSING.search(payload) is None:
            if _HAS_CONTENT.search(payload) is not None:
                self._token(now)
            elif payload.strip() == b"[DONE]":
                self.done = True
            return True
        try:
            obj = json.loads(payload)
        except ValueError:
            return True
        if not isinstance(obj, dict):
            return True
        if "error" in obj:
            error = obj["error"]
            self.upstream_error = str(error.get("message") if isinstance(error, dict) else error)[:500]
            return True
        choices = obj.get("choices")
        if obj.get("usage"):
            self.usage = Usage.parse(obj["usage"]) or self.usage
            self.facts = obj.get("chunkpilot", self.facts)
            if self.strip_usage and not choices:
                return False
        if choices and any(_has_content(choice) for choice in choices):
            self._token(now)
        return True

    def _token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            gap = now - (self.last_token_at or now)
            if gap > self.max_gap_seconds:
                self.max_gap_seconds = gap
            if len(self.gaps) < MAX_GAPS:
                self.gaps.append(gap)
        self.last_token_at = now
        self.num_token_events += 1

    # ---- the figures, once the stream has ended ----------------------------
    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def output_tokens(self) -> int:
        if self.usage is not None and self.usage.output_tokens is not None:
            return self.usage.output_tokens
        return self.num_token_events

    @property
    def tpot_seconds(self) -> float | None:
        """Time per output token after the first: decode speed as the user saw it."""
        n = self.output_tokens
        if self.first_token_at is None or self.last_token_at is None or n < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (n - 1)

    @property
    def gap_seconds(self) -> float | None:
        return self.max_gap_seconds if self.num_token_events >= 2 else None
