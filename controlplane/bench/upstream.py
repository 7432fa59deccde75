"""The gateway's upstream interface over httpx's AsyncClient: the other side
of ``bench_gateway --client httpx``, the comparison that chose the gateway's
own client (``controlplane/gateway/upstream.py`` says what it showed). It is
the benchmark's, never an operator's choice: a gateway runs it only when
``bench_gateway`` starts one (``HttpxGateway``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from controlplane.gateway.management.commands import rungateway
from controlplane.gateway.upstream import (
    OnHead,
    Upstream,
    UpstreamBroken,
    UpstreamTimedOut,
    UpstreamTimeouts,
    UpstreamUnavailable,
)


class _HttpxResponse:
    def __init__(self, response: Any):
        self._response = response
        self.status = response.status_code
        self.headers: list[tuple[bytes, bytes]] = [(k.lower(), v) for k, v in response.headers.raw]
        self._iterator: AsyncIterator[bytes] | None = None
        self._pipe: asyncio.Future[bool] | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def next_chunk(self) -> bytes | None:
        if self._iterator is None:
            self._iterator = self.chunks()
        return await anext(self._iterator, None)

    def pipe(self, on_data: Callable[[bytes], None]) -> asyncio.Future[bool]:
        async def run() -> bool:
            while (chunk := await self.next_chunk()) is not None:
                on_data(chunk)
            return True

        self._pipe = asyncio.ensure_future(run())
        return self._pipe

    def pause(self) -> None:
        pass  # httpx reads as the pipe's task asks; back-pressure is not passed on

    def resume(self) -> None:
        pass

    async def close(self) -> None:
        if self._pipe is not None:
            self._pipe.cancel()
        await self._response.aclose()


class HttpxUpstream:
    def __init__(self, timeouts: UpstreamTimeouts | None = None, *, max_connections: int = 2048):
        timeouts = timeouts or UpstreamTimeouts()
        self._read_seconds = timeouts.read_seconds
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=timeouts.connect_seconds, read=timeouts.read_seconds, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=False,  # workers are addressed directly, never through a proxy from the environment
        )

    def start(
        self, url: str, headers: list[tuple[bytes, bytes]], body: bytes, *, on_head: OnHead | None = None
    ) -> _HttpxPending:
        return _HttpxPending(self, url, headers, body, on_head)

    async def send(self, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> _HttpxResponse:
        request = self._client.build_request("POST", url, headers=headers, content=body)
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except httpx.ReadTimeout as exc:
            raise UpstreamTimedOut(f"no response head from the worker within {self._read_seconds:g}s") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()


class _HttpxPending:
    def __init__(
        self, client: HttpxUpstream, url: str, headers: list[tuple[bytes, bytes]], body: bytes, on_head: OnHead | None
    ):
        self._args, self._client, self._on_head = (url, headers, body), client, on_head

    async def response(self) -> _HttpxResponse:
        response = await self._client.send(*self._args)
        if self._on_head is not None:
            self._on_head(response)
        return response


CLIENTS: dict[str, type] = {"native": Upstream, "httpx": HttpxUpstream}


class HttpxGateway(rungateway.Command):
    """``manage.py rungateway`` with the httpx client (``bench_gateway --serve-gateway``)."""

    upstream_class = HttpxUpstream
