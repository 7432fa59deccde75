"""The heartbeat as production serves it: the ASGI fast path in front of
Django, on a real uvicorn process, answers exactly as the DRF view does."""

from __future__ import annotations

import httpx
import pytest
from rest_framework.test import APIClient

from controlplane.fleet import conf
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_pool, make_profile
from workers.contract import HEARTBEAT_PATH

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_fast_path_answers_as_the_view_does(web: str) -> None:
    revision = make_profile("fast")
    worker, secret = enroll_worker("fast-1", pool=make_pool(revision=revision))
    cases = [
        ({"Authorization": f"Bearer {secret}"}, heartbeat_request(running_revision_id=revision.pk)),
        ({}, heartbeat_request()),
        ({"Authorization": "Bearer cpw_unknown"}, heartbeat_request()),
        ({"Authorization": f"Bearer {secret}"}, heartbeat_request(state="asleep")),
        ({"Authorization": f"Bearer {secret}"}, None),
    ]
    django_client = APIClient()
    for headers, body in cases:
        fast = (
            httpx.post(f"{web}{HEARTBEAT_PATH}", json=body, headers=headers)
            if body is not None
            else httpx.post(
                f"{web}{HEARTBEAT_PATH}", content=b"{not json", headers={**headers, "Content-Type": "application/json"}
            )
        )
        view = django_client.post(
            HEARTBEAT_PATH,
            body if body is not None else "{not json",
            format="json" if body is not None else None,
            content_type=None if body is not None else "application/json",
            headers=headers,
        )
        assert fast.status_code == view.status_code, (headers, body, fast.text, view.content)
        assert set(fast.json()) == set(view.json())
        if fast.status_code == 401:
            assert fast.headers["WWW-Authenticate"] == view["WWW-Authenticate"]
    worker.refresh_from_db()
    assert (worker.state_label, worker.running_revision_id, worker.drift_since) == ("ready", revision.pk, None)


def test_other_paths_still_reach_django(web: str) -> None:
    assert httpx.get(f"{web}/login/").status_code == 200
    assert httpx.get(f"{web}{HEARTBEAT_PATH}").status_code in (401, 405)
    assert httpx.get(f"{web}/api/v1/pools/").status_code == 401


def test_concurrent_heartbeats_use_a_bounded_number_of_database_connections(web: str) -> None:
    """Each heartbeat thread keeps one connection; there are at most
    HEARTBEAT_THREADS of them, however many heartbeats arrive at once."""
    import asyncio

    from django.db import connection

    secrets = [enroll_worker(f"busy-{i}")[1] for i in range(40)]

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=web, limits=httpx.Limits(max_connections=40)) as client:
            replies = await asyncio.gather(
                *(
                    client.post(HEARTBEAT_PATH, json=heartbeat_request(), headers={"Authorization": f"Bearer {secret}"})
                    for secret in secrets * 5
                )
            )
        return [r.status_code for r in replies]

    # Its own thread: a browser test earlier in the session leaves Playwright's
    # event loop running in this one.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        statuses = pool.submit(asyncio.run, burst()).result()
    assert set(statuses) == {200}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        (server_connections,) = cursor.fetchone()
    assert 1 <= server_connections <= conf.HEARTBEAT_THREADS.get() + 1  # + the one /login/ used
    assert Worker.objects.filter(name__startswith="busy-", state=Worker.State.READY).count() == 40
