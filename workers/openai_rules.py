"""The rules for a completion request's body that the gateway and the worker
share: one validator, so a worker called directly refuses what the gateway
refuses. Pure: a parsed body in, an ``ApiError`` (400 naming the field) out.

- Parameters OpenAI or vLLM define that no engine implements
  (``UNSUPPORTED``, ``UNSUPPORTED_NUMBERS``) are refused by name instead of
  accepted and ignored; each one's neutral value (what asking for nothing
  looks like) is accepted.
- ``stream_options``: an object whose ``include_usage`` is a boolean, and only
  with ``stream: true`` (the gateway adds ``include_usage`` for its log, so it
  must read them too).
- ``logit_bias`` (OpenAI's: token id as a string -> a bias in [-100, 100]) and
  ``min_tokens`` (vLLM's: no EOS, stop token or stop string before that many
  output tokens) are implemented by both engines; their shapes and bounds are
  checked here, the token ids against the vocabulary by the engine.

The worker's own parsing (``workers/server/protocol.py``) then reads every
parameter it implements into ``SamplingParams``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from workers.openai_error import bad

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for one bias: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # biased tokens per request: each is a write into the logits row per step
MAX_TOKEN_COUNT = 2**31 - 1  # no request generates more; a larger count is a client's mistake
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
# Penalties no engine implements: their bounds are checked as vLLM checks
# them, and any value other than the neutral one is refused by name.
# (name, neutral value, check, the rule in words)
UNSUPPORTED_NUMBERS: tuple[tuple[str, float, Callable[[float], bool], str], ...] = (
    ("presence_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("frequency_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("repetition_penalty", 1.0, lambda v: v > 0.0, "greater than 0"),
    ("min_p", 0.0, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
)


def check_request(data: dict[str, Any], *, chat: bool) -> None:
    """Raises ``ApiError`` (400 naming the field) for a body both refuse."""
    for name, (accepted, why) in UNSUPPORTED.items():
        if name in data and not accepted(data[name]):
            raise bad(why, param=name)
    for name, neutral, check, rule in UNSUPPORTED_NUMBERS:
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise bad(f"`{name}` must be a finite number.", param=name)
        if not check(value):
            raise bad(f"`{name}` must be {rule}; got {value}.", param=name)
        if value != neutral:
            raise bad(f"`{name}` is not supported (only {neutral}); got {value}.", param=name)
    include_usage(data)
    logit_bias(data)
    min_tokens(data, chat=chat)


def include_usage(data: dict[str, Any]) -> bool:
    """``stream_options.include_usage``, checked."""
    options = data.get("stream_options")
    if options is None:
        return False
    if data.get("stream") is not True:
        raise bad("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    if not isinstance(options, dict):
        raise bad("`stream_options` must be an object.", param="stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad("`stream_options.include_usage` must be true or false.", param="stream_options.include_usage")
    return value


def logit_bias(data: dict[str, Any]) -> dict[int, float]:
    """``logit_bias`` as {token id: bias}; {} when absent."""
    value = data.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("`logit_bias` must be an object mapping token ids to biases.", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"`logit_bias` may bias at most {MAX_LOGIT_BIAS_ENTRIES} tokens; got {len(value)}.", "logit_bias")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        # JSON keys are strings; "007" or "+7" is not a token id as written.
        if not (isinstance(key, str) and key.isdecimal() and key.isascii() and str(int(key)) == key):
            raise bad(f"`logit_bias` keys must be token ids (non-negative integers); got {key!r}.", "logit_bias")
        if int(key) > MAX_TOKEN_COUNT:
            raise bad(f"`logit_bias` names token id {key}, past any vocabulary.", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise bad(f"`logit_bias[{key}]` must be a finite number.", param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise bad(f"`logit_bias[{key}]` must be in [-100, 100]; got {bias}.", param="logit_bias")
        biases[int(key)] = float(bias)
    return biases


def output_limit_field(data: dict[str, Any], chat: bool) -> str:
    """The field that limits the output, as the worker reads it: chat prefers
    ``max_completion_tokens`` (OpenAI's current name) over ``max_tokens``."""
    if chat and data.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    if data.get("max_tokens") is not None or not chat:
        return "max_tokens"
    return "max_completion_tokens"


def min_tokens(data: dict[str, Any], *, chat: bool) -> int:
    """``min_tokens``, 0 when absent: at most the output limit the request
    names (a completion's default of 16 included), which it could never reach."""
    value = data.get("min_tokens")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad("`min_tokens` must be an integer.", param="min_tokens")
    if not 0 <= value <= MAX_TOKEN_COUNT:
        raise bad(f"`min_tokens` must be in [0, {MAX_TOKEN_COUNT}]; got {value}.", param="min_tokens")
    name = output_limit_field(data, chat)
    limit = data.get(name)
    if limit is None and not chat:
        limit = DEFAULT_COMPLETION_MAX_TOKENS
    # A limit that is not a whole number is refused by name where it is read.
    if isinstance(limit, int) and not isinstance(limit, bool) and value > limit:
        raise bad(f"`min_tokens` ({value}) must be at most `{name}` ({limit}).", param="min_tokens")
    return value
