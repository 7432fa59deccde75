"""The fleet consumer over the real Redis channel layer: a heartbeat that
changes a worker's state reaches a connected page as an htmx swap."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from asgiref.testing import ApplicationCommunicator
from django.contrib.auth.models import AnonymousUser

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Worker
from dashboards.consumers import FORBIDDEN, FleetConsumer
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_user
from workers.contract import parse_heartbeat

pytestmark = pytest.mark.django_db(transaction=True)
T = TypeVar("T")


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on a fresh event loop in a fresh thread: when a browser test ran
    earlier in this session, Playwright's loop is already running in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class Socket:
    """A websocket client speaking raw ASGI to the consumer (channels'
    WebsocketCommunicator would need daphne installed just to import)."""

    def __init__(self, user: Any):
        scope = {"type": "websocket", "path": "/ws/fleet/", "headers": [], "subprotocols": [], "user": user}
        self.app = ApplicationCommunicator(FleetConsumer.as_asgi(), scope)

    async def connect(self) -> tuple[bool, Any]:
        await self.app.send_input({"type": "websocket.connect"})
        reply = await self.app.receive_output(5)
        return reply["type"] == "websocket.accept", reply.get("code")

    async def receive_from(self, timeout: float) -> str:
        message = await self.app.receive_output(timeout)
        assert message["type"] == "websocket.send", message
        return str(message["text"])

    async def disconnect(self) -> None:
        await self.app.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.app.wait(2)


def communicator(user: Any) -> Socket:
    return Socket(user)


def test_a_state_change_is_pushed_as_the_workers_row() -> None:
    worker, _ = enroll_worker("pushed")
    viewer = make_user(Role.VIEWER)

    async def scenario() -> str:
        comm = communicator(viewer)
        connected, _ = await comm.connect()
        assert connected
        from channels.db import database_sync_to_async

        await database_sync_to_async(
            lambda: Worker.objects.get(pk=worker.pk).record_heartbeat(parse_heartbeat(heartbeat_request("ready")))
        )()
        messages = [await comm.receive_from(timeout=10), await comm.receive_from(timeout=10)]
        await comm.disconnect()
        return messages

    row, summary = run_async(scenario())
    html = row + summary
    assert row.startswith(f'<tr id="worker-{worker.pk}" data-worker="pushed" data-state="ready" hx-swap-oob="true">')
    assert summary.startswith('<div id="fleet-summary" class="summary" hx-swap-oob="true">')
    assert "drain" not in html, "a viewer's push carries no buttons"


def test_a_new_worker_pushes_the_whole_table_body() -> None:
    operator = make_user(Role.OPERATOR)

    async def scenario() -> str:
        comm = communicator(operator)
        await comm.connect()
        from channels.db import database_sync_to_async

        await database_sync_to_async(lambda: enroll_worker("newcomer"))()
        message = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return message

    html = run_async(scenario())
    assert html.startswith('<tbody id="fleet-rows" hx-swap-oob="true"') and "newcomer" in html
    assert ">drain</button>" in html, "an operator's push carries the buttons"


@pytest.mark.parametrize("role", [None, Role.NONE])
def test_visitors_without_a_role_are_refused(role: Role | None) -> None:
    user = AnonymousUser() if role is None else make_user(role)

    async def scenario() -> tuple[bool, Any]:
        comm = communicator(user)
        connected, code = await comm.connect()
        return connected, code

    assert run_async(scenario()) == (False, FORBIDDEN)
