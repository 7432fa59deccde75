"""A synthetic OpenAI worker: streams made-up tokens on a fixed clock.

``python -m controlplane.bench.synthetic --port P [--name N] [--ttft-ms 20]
[--itl-ms 20]`` serves /v1/completions, /v1/chat/completions (streamed or
not, with ``stream_options.include_usage``), /v1/models, /health and
/stats (how many requests it took).

It exists for measuring the gateway itself. A real engine's TTFT on shared
CPU cores varies by tens of milliseconds with load, which would drown the
sub-millisecond figure the gateway benchmark is after; this one answers
after exactly ``--ttft-ms`` and costs almost no CPU. Like the real worker
server, it sends the response head together with the first token. It never
imports Django.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

Scope = dict[str, Any]


class SyntheticWorker:
    def __init__(
        self,
        *,
        name: str,
        model: str,
        ttft_seconds: float,
        itl_seconds: float,
        default_max_tokens: int,
        status: int = 200,
    ):
        self.name = name
        self.model = model
        self.ttft_seconds = ttft_seconds
        self.itl_seconds = itl_seconds
        self.default_max_tokens = default_max_tokens
        self.status = status
        self.num_requests = 0
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # served with lifespan off
        path = scope["path"]
        if path in ("/v1/completions", "/v1/chat/completions") and scope["method"] == "POST":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            self.num_requests += 1
            self.in_flight += 1
            try:
                await self._complete(path.endswith("chat/completions"), json.loads(body or b"{}"), send)
            finally:
                self.in_flight -= 1
        elif path == "/health":
            await _json(send, 200, {"status": "ready", "name": self.name})
        elif path == "/stats":
            await _json(send, 200, {"name": self.name, "requests": self.num_requests, "in_flight": self.in_flight})
        elif path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            await _json(send, 404, {"error": {"message": "no route", "type": "not_found_error"}})

    async def _complete(self, chat: bool, data: dict[str, Any], send: Any) -> None:
        if self.status != 200:
            # 429 and 503 with the real worker's codes for a request it did not admit.
            code = {429: "queue_full", 503: "worker_draining"}.get(self.status, "synthetic")
            await _json(
                send,
                self.status,
                {
                    "error": {
                        "message": f"{self.name} answers {self.status}",
                        "type": "service_unavailable",
                        "code": code,
                    }
                },
                [(b"retry-after", b"1")],
            )
            return
        max_tokens = int(data.get("max_tokens") or data.get("max_completion_tokens") or self.default_max_tokens)
        prompt = (
            data.get("prompt") if not chat else " ".join(str(m.get("content", "")) for m in data.get("messages", []))
        )
        num_prompt_tokens = max(1, len(str(prompt).split()))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage = {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": num_prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        texts = [f" {self.name}-{i}" for i in range(max_tokens)]
        await asyncio.sleep(self.ttft_seconds)
        if not data.get("stream"):
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(texts)},
                    "finish_reason": "length",
                }
            else:
                choice = {"index": 0, "text": "".join(texts), "logprobs": None, "finish_reason": "length"}
            await _json(
                send,
                200,
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": self.model,
                    "choices": [choice],
                    "usage": usage,
                },
            )
            return

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = (
                    {"role": "assistant", "content": text or ""}
                    if first
                    else ({"content": text} if text is not None else {})
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")],
            }
        )
        next_at = time.perf_counter()
        for i, text in enumerate(texts):
            if i:
                next_at += self.itl_seconds
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            last = i == len(texts) - 1
            await send(
                {
                    "type": "http.response.body",
                    "body": chunk(text, "length" if last else None, first=i == 0),
                    "more_body": True,
                }
            )
        tail = b""
        options = data.get("stream_options") or {}
        if options.get("include_usage"):
            payload = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [], "usage": usage}
            tail += b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})


async def _json(send: Any, status: int, data: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.bench.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="synthetic")
    parser.add_argument("--model", default="synthetic")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens when the request does not say")
    parser.add_argument("--status", type=int, default=200, help="answer every completion with this status instead")
    args = parser.parse_args(argv)
    import uvicorn

    app = SyntheticWorker(
        name=args.name,
        model=args.model,
        ttft_seconds=args.ttft_ms / 1000,
        itl_seconds=args.itl_ms / 1000,
        default_max_tokens=args.max_tokens,
        status=args.status,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=4096,
        timeout_keep_alive=30,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
