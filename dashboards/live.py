"""What every live page shares: the htmx request type, the role-gated
websocket consumer and its push helper. See docs/architecture.md, "Web UI"
and "Live updates".

A page's live part is a partial (``templates/<domain>/partials/``) rendered
three ways by one function in ``dashboards/<domain>/pages.py``: inside the
page, alone for an htmx request (``request.htmx``), and as an out-of-band
swap pushed down the page's websocket when ``controlplane.live`` publishes
an event the page's consumer listens to.

A store outage ends a socket cleanly (``OutageGuard``): an open one closes
with 1013 "try again later" and the reason, a handshake is refused, and the htmx ws extension reconnects with backoff
on either while the
page shows "live updates paused" (``dashboards/static/dashboards/app.js``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.http import HttpRequest
from django_htmx.middleware import HtmxDetails

from controlplane import outages
from controlplane.accounts.roles import Role, role_of

log = logging.getLogger(__name__)

# Websocket close codes, HTTP's status in the application range (4000-4999).
FORBIDDEN = 4403
NOT_FOUND = 4404
# RFC 6455's "try again later": the htmx ws extension reconnects on it.
TRY_AGAIN_LATER = 1013

# What a push renders: one fragment, several (each sent as its own message),
# or nothing to send.
Rendered = str | Iterable[str] | None


class HtmxHttpRequest(HttpRequest):
    """A request as django-htmx's middleware leaves it: ``request.htmx`` is
    true for an htmx request and tells its target, trigger and so on."""

    htmx: HtmxDetails


class LiveConsumer(AsyncWebsocketConsumer):
    """One live view's websocket.

    Checks the visitor's role before anything else (4403 below ``min_role``),
    then joins the groups ``live_groups()`` names (4404 when it returns None:
    the page's object is gone) and accepts. A subclass has one handler per
    event, named after it (``fleet_worker_changed`` for
    ``fleet.worker_changed``), that calls ``push``.

    ``user_context`` (the role and what it may do), ``params`` (the page's
    query string) and ``url_kwargs`` (the route's) are set before
    ``live_groups()`` runs.
    """

    min_role = Role.VIEWER

    async def connect(self) -> None:
        self.joined: list[str] = []
        role = await database_sync_to_async(role_of)(self.scope.get("user"))
        if role < self.min_role:
            await self.close(code=FORBIDDEN)
            return
        self.user_context: dict[str, Any] = {"role": role.group_name, "can_operate": role >= Role.OPERATOR}
        self.params = dict(parse_qsl(self.scope.get("query_string", b"").decode()))
        self.url_kwargs: dict[str, Any] = self.scope.get("url_route", {}).get("kwargs", {})
        groups = await self.live_groups()
        if groups is None:
            await self.close(code=NOT_FOUND)
            return
        for name in groups:
            await self.channel_layer.group_add(name, self.channel_name)
            self.joined.append(name)
        await self.accept()

    async def live_groups(self) -> list[str] | None:
        """The channel-layer groups to join (``controlplane.live.group``)."""
        raise NotImplementedError

    async def disconnect(self, code: int) -> None:
        for name in getattr(self, "joined", []):
            # Redis away: its groups expire on their own (channels_redis' group_expiry).
            with contextlib.suppress(*outages.REDIS_ERRORS):
                await self.channel_layer.group_discard(name, self.channel_name)

    async def push(self, render: Callable[..., Rendered], *args: Any, **kwargs: Any) -> None:
        """``render(*args, **kwargs)`` off the event loop (it reads the
        database), then each fragment down the socket as its own message:
        htmx parses a message inside a <template>, where the HTML parser drops
        a <tr> that follows a <div>."""
        rendered = await database_sync_to_async(render)(*args, **kwargs)
        if rendered is None:
            return
        for html in [rendered] if isinstance(rendered, str) else rendered:
            await self.send(text_data=html.strip())


Message = MutableMapping[str, Any]


class OutageGuard:
    """ASGI middleware around every websocket: a store outage (Redis under the
    channel layer, PostgreSQL under the session or a push's render) ends the
    socket cleanly instead of as "Exception in ASGI application" with no
    close frame. An open socket gets 1013 and the reason; a handshake not yet
    accepted is refused. The htmx ws extension reconnects on either."""

    def __init__(self, app: Callable[[Message, Any, Any], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        sent: set[str] = set()

        async def tracking_send(message: Message) -> None:
            sent.add(message["type"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            store = outages.store_down(exc)
            if store is None:
                raise
            outages.note(store, exc, f"the websocket {scope.get('path', '')}")
            if "websocket.close" in sent:
                return
            with contextlib.suppress(Exception):  # the client may be gone already
                await send(_closing(store, accepted="websocket.accept" in sent))


def _closing(store: str, *, accepted: bool) -> Message:
    if not accepted:
        # Refused before the handshake completes (the server answers 403), so
        # the browser's reconnects back off; uvicorn logs a denial response
        # (``websocket.http.response``) as an error, a close not.
        return {"type": "websocket.close", "code": TRY_AGAIN_LATER}
    reason = f"live updates paused: the control plane's {store} is unreachable"
    return {"type": "websocket.close", "code": TRY_AGAIN_LATER, "reason": reason}
