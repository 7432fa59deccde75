"""The fleet consumer over the real Redis channel layer: a heartbeat that
changes a worker's state reaches a connected page as an htmx swap."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Worker
from dashboards.live import FORBIDDEN
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_user
from tests.dashboards.support import run, socket
from workers.contract import parse_heartbeat

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_state_change_is_pushed_as_the_workers_row() -> None:
    worker, _ = enroll_worker("pushed")
    viewer = make_user(Role.VIEWER)

    async def scenario() -> list[str]:
        comm = socket("/ws/fleet/", viewer)
        connected, _ = await comm.connect()
        assert connected
        await database_sync_to_async(
            lambda: Worker.objects.get(pk=worker.pk).record_heartbeat(parse_heartbeat(heartbeat_request("ready")))
        )()
        messages = [await comm.receive_from(timeout=10), await comm.receive_from(timeout=10)]
        await comm.disconnect()
        return messages

    row, summary = run(scenario)
    html = row + summary
    assert row.startswith(f'<tr id="worker-{worker.pk}" data-worker="pushed" data-state="ready" hx-swap-oob="true">')
    assert summary.startswith('<div id="fleet-summary" class="summary" hx-swap-oob="true">')
    assert "drain" not in html, "a viewer's push carries no buttons"


def test_a_new_worker_pushes_the_whole_table_body() -> None:
    operator = make_user(Role.OPERATOR)

    async def scenario() -> str:
        comm = socket("/ws/fleet/", operator)
        await comm.connect()
        await database_sync_to_async(lambda: enroll_worker("newcomer"))()
        message = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return message

    html = run(scenario)
    assert html.startswith('<tbody id="fleet-rows" hx-swap-oob="true"') and "newcomer" in html
    assert ">drain</button>" in html, "an operator's push carries the buttons"


@pytest.mark.parametrize("role", [None, Role.NONE])
def test_visitors_without_a_role_are_refused(role: Role | None) -> None:
    user = AnonymousUser() if role is None else make_user(role)

    async def scenario() -> tuple[bool, Any]:
        return await socket("/ws/fleet/", user).connect()

    assert run(scenario) == (False, FORBIDDEN)
