"""OpenAI's error reply, one type for the worker and the gateway.

``{"error": {"message", "type", "param", "code"}}`` with an HTTP status and
any headers the reply carries (``Retry-After``). The worker raises it from
its request parsing and its admission; the gateway raises it from its own
path and reads a worker's error body back into it (``from_reply``), so a
field a worker named reaches the client as the worker named it. Pure: no
Django, no web framework.
"""

from __future__ import annotations

import json
from typing import Any

# How much of a worker's error text is kept (a reply's message, a log row's error).
MAX_MESSAGE_CHARS = 500


class ApiError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode()

    @classmethod
    def from_reply(cls, status: int, payload: bytes, headers: dict[str, str] | None = None) -> ApiError:
        """A worker's error reply read back. A body that is not OpenAI's shape
        (a proxy's page, plain text) keeps its first characters as the message."""
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError):
            data = None
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict):
            return cls(
                str(error.get("message", ""))[:MAX_MESSAGE_CHARS],
                status=status,
                type=_text(error.get("type")) or "invalid_request_error",
                param=_text(error.get("param")),
                code=_text(error.get("code")),
                headers=headers,
            )
        message = str(error) if error is not None else payload[:MAX_MESSAGE_CHARS].decode("utf-8", "replace")
        return cls(message[:MAX_MESSAGE_CHARS], status=status, type="server_error", headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for the request's own fault, naming the field."""
    return ApiError(message, param=param, code=code)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
