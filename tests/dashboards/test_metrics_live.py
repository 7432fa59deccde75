"""The metric pages' consumers over the real Redis channel layer, through
Channels' WebsocketCommunicator and the project's ASGI router: a scrape
round reaches a connected page as its live partial, with the new figures,
within two seconds."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import pytest
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.utils import timezone

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import live, scrape
from dashboards.consumers_metrics import FORBIDDEN
from dashboards.routing import websocket_urlpatterns
from tests.controlplane.factories import make_user
from tests.controlplane.metrics.pages import Page, job, store

pytestmark = pytest.mark.django_db(transaction=True)

PUSH_DEADLINE_SECONDS = 2.0
T = TypeVar("T")


class _Injected:
    """The scope's user as AuthMiddlewareStack would set it from a session."""

    def __init__(self, app: Any, user: Any):
        self.app, self.user = app, user

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        return await self.app({**scope, "user": self.user}, receive, send)


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run an async scenario on its own event loop in its own thread: a
    session's Playwright browser keeps a loop running in the main thread,
    where async_to_sync refuses to work."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, scenario()).result(timeout=60)


def socket(path: str, user: Any) -> WebsocketCommunicator:
    return WebsocketCommunicator(_Injected(URLRouter(websocket_urlpatterns), user), path)


def scraped_worker() -> tuple[Worker, Any]:
    w = Worker.objects.create(name="gpu-1", url="http://gpu-1.invalid", pool=Pool.objects.create(name="p1"))
    return w, job(w, "stable")


def page(n: int) -> Page:
    return Page(counters={"vllm:request_success_total": 100.0 + n})


def test_a_scrape_pushes_the_panel_with_the_new_figures_within_two_seconds() -> None:
    worker, j = scraped_worker()
    now = timezone.now()
    for i in range(12):
        store(now - timedelta(seconds=55 - 5 * i), {j: page(10 * i)})  # 2 requests/s
    viewer = make_user(Role.VIEWER)

    async def scenario() -> tuple[str, float]:
        comm = socket("/ws/metrics/cohorts/?window=1m", viewer)
        connected, _ = await comm.connect()
        assert connected
        started = time.monotonic()
        # What the scraper does after committing a round: one group_send per group.
        await database_sync_to_async(live.notify_scraped)(timezone.now(), [worker.pk])
        html = await comm.receive_from(timeout=10)
        elapsed = time.monotonic() - started
        await comm.disconnect()
        return html, elapsed

    html, elapsed = run(scenario)
    assert html.startswith('<div id="metrics-cohorts-live" hx-swap-oob="true">')
    row = html.split('data-figure="requests_per_second"', 1)[1].split("</tr>", 1)[0]
    rate = float(re.search(r'<td data-cohort="stable">([0-9.]+)/s</td>', row).group(1))
    # 2/s, a little less when the push comes later than half a scrape after
    # the last sample (then the window's start is extrapolated half an interval).
    assert 1.9 <= rate <= 2.0
    assert elapsed < PUSH_DEADLINE_SECONDS


def test_the_scraper_itself_pushes_a_round_to_the_worker_page(settings: Any) -> None:
    """scrape_fleet → commit → group_send → consumer → websocket, with the
    worker's server answering from a real HTTP socket."""
    from tests.workers.server.support import ThreadedServer

    body = {"text": page(0).text()}

    async def metrics_app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body["text"].encode()})

    viewer = make_user(Role.VIEWER)
    with ThreadedServer(metrics_app) as server:
        worker = Worker.objects.create(name="gpu-2", url=server.url, pool=Pool.objects.create(name="p2"), state=1)
        scrape.scrape_fleet(now=timezone.now() - timedelta(seconds=5))
        body["text"] = page(50).text()

        async def scenario() -> str:
            comm = socket(f"/ws/metrics/worker/{worker.pk}/?window=1m", viewer)
            connected, _ = await comm.connect()
            assert connected
            await database_sync_to_async(scrape.scrape_fleet)()
            html = await comm.receive_from(timeout=10)
            await comm.disconnect()
            return html

        html = run(scenario)
    assert html.startswith('<div id="metrics-panel-live" hx-swap-oob="true">')
    assert 'id="chart-data-ttft"' in html and '"lines"' in html
    assert 'data-group="fleet"' in html


@pytest.mark.parametrize("role", [None, Role.NONE])
def test_visitors_without_a_role_are_refused(role: Role | None) -> None:
    user = AnonymousUser() if role is None else make_user(role)

    async def scenario() -> tuple[bool, Any]:
        comm = socket("/ws/metrics/panel/", user)
        return await comm.connect()

    assert run(scenario) == (False, FORBIDDEN)


def test_a_worker_page_for_a_missing_worker_is_closed() -> None:
    viewer = make_user(Role.VIEWER)

    async def scenario() -> tuple[bool, Any]:
        return await socket("/ws/metrics/worker/999999/", viewer).connect()

    connected, _ = run(scenario)
    assert not connected
