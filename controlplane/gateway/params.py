"""The output-token cap the gateway writes into a completion request's body
before it picks a worker. Pure: a parsed body in, an ``ApiError`` naming the
field out.

The rules the gateway and the worker share (parameters no worker implements,
``stream_options``, ``logit_bias``, ``min_tokens``) are one validator,
``workers/openai_rules.py``, which the gateway runs first. Only the cap is
the gateway's own: the smaller of the client key's and the route's
``max_output_tokens``. A request that asks for more is refused (400 naming
the field, as OpenAI does for a model's limit); one that names no limit gets
the cap written in. No cap set: the body is left alone, and the worker's
default (vLLM's: up to the context's end) holds.
"""

from __future__ import annotations

import math
from typing import Any

from workers.openai_error import bad
from workers.openai_rules import output_limit_field


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
        raise bad(f"`{name}` asks for more than this key's or model's limit of {cap} output tokens.", param=name)
    return False


def output_cap(*caps: int | None) -> int | None:
    """The tightest of the caps that are set."""
    set_caps = [c for c in caps if c is not None]
    return min(set_caps) if set_caps else None
