"""What the gateway itself checks in a completion request's body, before it
picks a worker. Pure: a parsed body in, a ``ParamError`` naming the field out.

The worker validates every parameter it implements (``workers/server/protocol.py``);
the gateway checks only what it must understand itself or what no worker
implements:

- ``stream_options``: the gateway adds ``include_usage`` to a stream's
  options (for the request log), so it must read them. They must be an
  object whose ``include_usage`` is a boolean, and only with ``stream: true``,
  as the worker and vLLM require; anything else is refused, never coerced.
- Parameters OpenAI defines that no worker implements (``UNSUPPORTED``):
  refused with a 400 naming them, as the worker refuses ``n`` > 1, instead of
  being accepted and ignored. Each one's neutral value (what asking for
  nothing looks like) is accepted.
- The output-token cap (``apply_output_cap``): the smaller of the client
  key's and the route's ``max_output_tokens``. A request that asks for more
  is refused (400 naming the field, as OpenAI does for a model's limit); one
  that names no limit gets the cap written in. No cap set: the body is left
  alone, and the worker's default (vLLM's: up to the context's end) holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


class ParamError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def _absent_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == n and type(value) is type(n) for n in neutral)


# name -> (accepted values, why it is refused)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_absent_or(1), "only best_of=1 is supported."),
    "suffix": (_absent_or(""), "`suffix` (insertion) is not supported."),
    "tools": (_absent_or([]), "tool calling is not supported: `tools` must be empty or left out."),
    "tool_choice": (_absent_or("none"), 'tool calling is not supported: `tool_choice` may only be "none".'),
    "response_format": (
        lambda value: value is None or value == {"type": "text"},
        'structured output is not supported: `response_format` may only be {"type": "text"}.',
    ),
}


def check_request(data: dict[str, Any]) -> None:
    """Raises ``ParamError`` for a body the gateway must refuse."""
    for name, (accepted, why) in UNSUPPORTED.items():
        if name in data and not accepted(data[name]):
            raise ParamError(why, name)
    check_stream_options(data)


def check_stream_options(data: dict[str, Any]) -> None:
    options = data.get("stream_options")
    if options is None:
        return
    if data.get("stream") is not True:
        raise ParamError("`stream_options` is only allowed when `stream` is true.", "stream_options")
    if not isinstance(options, dict):
        raise ParamError("`stream_options` must be an object.", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise ParamError("`stream_options.include_usage` must be true or false.", "stream_options.include_usage")


def output_limit_field(data: dict[str, Any], chat: bool) -> str:
    """The field that limits the output, as the worker reads it: chat prefers
    ``max_completion_tokens`` (OpenAI's current name) over ``max_tokens``."""
    if chat and data.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    if data.get("max_tokens") is not None or not chat:
        return "max_tokens"
    return "max_completion_tokens"


def apply_output_cap(data: dict[str, Any], chat: bool, cap: int | None) -> bool:
    """Enforces ``cap`` on ``data`` in place; True when the body changed.
    A limit that is not a whole number is left for the worker to refuse."""
    if cap is None:
        return False
    name = output_limit_field(data, chat)
    asked = data.get(name)
    if asked is None:
        # A completion's default is 16 tokens (OpenAI's); a chat's runs to
        # the context's end. Either way no more than the cap.
        if not chat and cap >= 16:
            return False
        data[name] = cap
        return True
    if isinstance(asked, bool) or not isinstance(asked, int | float):
        return False
    if isinstance(asked, float) and not math.isfinite(asked):  # (an int may be past any float: not math's)
        return False
    if asked > cap:
        raise ParamError(f"`{name}` asks for more than this key's or model's limit of {cap} output tokens.", name)
    return False


def output_cap(*caps: int | None) -> int | None:
    """The tightest of the caps that are set."""
    set_caps = [c for c in caps if c is not None]
    return min(set_caps) if set_caps else None
