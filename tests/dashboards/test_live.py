"""What every live page shares, when a store is away: a websocket closes
cleanly with a reason (1013, "try again later", on which the htmx ws
extension reconnects), a handshake is refused instead of failing, and a new
socket connects again once the store is back. Over a real redis-server of the
test's own, stopped and started again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from controlplane.accounts.roles import Role
from dashboards.live import TRY_AGAIN_LATER, OutageGuard
from dashboards.routing import websocket_urlpatterns
from tests.controlplane.factories import make_user
from tests.dashboards.support import run
from tests.faults.stores import OwnRedis

pytestmark = pytest.mark.django_db(transaction=True)


class _Injected:
    def __init__(self, app: Any, user: Any):
        self.app, self.user = app, user

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        return await self.app({**scope, "user": self.user}, receive, send)


def guarded_socket(path: str, user: Any) -> WebsocketCommunicator:
    """As asgi.py serves it: the guard outside the rest."""
    return WebsocketCommunicator(OutageGuard(_Injected(URLRouter(websocket_urlpatterns), user)), path)


@pytest.fixture
def own_redis(tmp_path: Path, settings: Any) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    # The channel layer on this server only (channels resets its layers on the change).
    layers = {"default": {**settings.CHANNEL_LAYERS["default"]}}
    layers["default"]["CONFIG"] = {
        **layers["default"]["CONFIG"],
        "hosts": [{"address": f"redis://127.0.0.1:{server.port}/0", "socket_timeout": 15}],
    }
    settings.CHANNEL_LAYERS = layers
    settings.REDIS_URL = f"redis://127.0.0.1:{server.port}/0"
    yield server
    server.stop()


def test_a_socket_closes_with_a_reason_when_redis_goes_and_connects_again_when_it_returns(
    own_redis: OwnRedis,
) -> None:
    viewer = make_user(Role.VIEWER)

    async def open_then_lose_redis() -> dict[str, Any]:
        comm = guarded_socket("/ws/fleet/", viewer)
        connected, _ = await comm.connect(timeout=10)
        assert connected
        own_redis.stop()
        closing = await comm.receive_output(timeout=30)
        await comm.wait(timeout=5)
        return closing

    closing = run(open_then_lose_redis)
    assert closing["type"] == "websocket.close" and closing["code"] == TRY_AGAIN_LATER
    assert closing["reason"] == "live updates paused: the control plane's redis is unreachable"

    async def handshake() -> tuple[bool, Any]:
        comm = guarded_socket("/ws/fleet/", viewer)
        result = await comm.connect(timeout=10)
        await comm.disconnect()
        return result

    assert run(handshake) == (False, TRY_AGAIN_LATER), "refused cleanly while Redis is down, not an exception"
    own_redis.start()
    assert run(handshake)[0] is True, "a new socket connects once Redis is back"
