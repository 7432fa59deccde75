"""Helpers the UI tests share: a websocket client through the project's own
router, async scenarios run off the test's thread, and signing in a
headless browser."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import quote

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.db import connections

from controlplane.accounts.roles import Role
from dashboards.routing import websocket_urlpatterns
from tests.controlplane.factories import make_user

T = TypeVar("T")
PASSWORD = "pw-ui-tests"
# Set before any page script runs: every websocket the page opens, by its ws-connect path.
RECORD_SOCKETS = """window.openSockets = [];
document.addEventListener('htmx:wsOpen', (e) => window.openSockets.push(e.target.getAttribute('ws-connect')));"""


SCENARIO_TIMEOUT_SECONDS = 60


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run an async scenario on its own event loop in its own thread: a
    session's Playwright browser keeps a loop running in the main thread,
    where async_to_sync refuses to work.

    The scenario's thread-sensitive sync code (``database_sync_to_async``) runs
    in a thread of its own (``ThreadSensitiveContext``), not in asgiref's one
    process-wide thread: a call left blocked there by another test cannot
    stall this one. A scenario that does not finish fails the test after
    ``SCENARIO_TIMEOUT_SECONDS`` instead of hanging it."""

    async def isolated() -> T:
        async with ThreadSensitiveContext():
            try:
                return await asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_SECONDS)
            finally:
                # That thread's database connection goes with it.
                await sync_to_async(connections.close_all)()

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(asyncio.run, isolated()).result(timeout=SCENARIO_TIMEOUT_SECONDS + 15)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class _Injected:
    """The scope's user as AuthMiddlewareStack would set it from a session."""

    def __init__(self, app: Any, user: Any):
        self.app, self.user = app, user

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        return await self.app({**scope, "user": self.user}, receive, send)


class _Communicator(WebsocketCommunicator):
    """Channels' test client with a handshake deadline for a loaded machine:
    its default (one second) is shorter than a busy CI's first database
    round trip, and the answer, not its speed, is what these tests check.

    A refused handshake ends the way a server ends it: the client's
    ``websocket.disconnect`` follows, and the consumer exits. Left running,
    its channel-layer receive was cancelled only by ``asyncio.run``'s
    shutdown, together with the consumer itself, and that receive (inside
    redis-py's read) never finished: the next scenario's thread hung."""

    async def connect(self, timeout: float = 10) -> Any:
        connected, code = await super().connect(timeout)
        if not connected:
            await self.send_input({"type": "websocket.disconnect", "code": code})
            await self.wait(timeout)
        return connected, code


def socket(path: str, user: Any) -> WebsocketCommunicator:
    """A websocket to ``path`` (with its query string) through
    ``dashboards.routing``, as ``user``."""
    return _Communicator(_Injected(URLRouter(websocket_urlpatterns), user), path)


def sign_in(page: Any, base: str, role: Role, path: str = "/") -> None:
    """A new user with ``role`` signs in on the login page and lands on
    ``path``; the page's websockets are recorded (``wait_for_socket``)."""
    username = f"ui-{role.group_name}"
    make_user(role, username=username, password=PASSWORD)
    page.add_init_script(RECORD_SOCKETS)
    page.goto(f"{base}/login/?next={quote(path)}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    landing = f"{base}{path}"
    page.wait_for_url(lambda url: url == landing)


def wait_for_socket(page: Any, *paths: str) -> None:
    """Until the page's websockets at ``paths`` (whatever their query
    strings) are open, then mark the page so that a test can tell it was
    never reloaded (``not_reloaded``). Every page also opens the banner's."""
    page.wait_for_function(
        "(paths) => paths.every((p) => window.openSockets.some((s) => s.split('?')[0] === p))",
        arg=list(paths),
        timeout=15000,
    )
    page.evaluate("window.notReloaded = true")


def not_reloaded(page: Any) -> bool:
    return page.evaluate("window.notReloaded") is True
