"""The metric pages' consumers over the real Redis channel layer, through
Channels' WebsocketCommunicator and the project's ASGI router: a scrape
round reaches a connected page as its live partial, with the new figures,
within two seconds; with the Prometheus backend, where the control plane
scrapes nothing, beat's tick still does, with the figures read from
Prometheus."""

from __future__ import annotations

import json
import math
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser
from django.test import override_settings
from django.utils import timezone

from controlplane import live
from controlplane.accounts.roles import Role
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import deploy, scrape, tasks
from controlplane.metrics.models import ScrapeRound
from dashboards.live import FORBIDDEN
from tests.controlplane.factories import make_user
from tests.controlplane.metrics.pages import Page, job, store
from tests.controlplane.metrics.test_real_prometheus import wait_for
from tests.dashboards.support import run, socket
from tests.monitoring import prometheus

pytestmark = pytest.mark.django_db(transaction=True)

PUSH_DEADLINE_SECONDS = 2.0


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
        # What the scraper does after committing a round.
        await database_sync_to_async(live.publish)(
            live.Event.METRICS_SCRAPED, scopes=[worker.pk], at=timezone.now().timestamp(), worker_ids=[worker.pk]
        )
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


@pytest.mark.slow
def test_under_the_prometheus_backend_beats_tick_pushes_the_panel_read_from_prometheus(tmp_path: Path) -> None:
    """No scrape round, so nothing else would publish: the beat task itself
    tells the page, which re-renders from a real Prometheus scraping a worker."""
    from tests.workers.server.support import ThreadedServer

    started = time.monotonic()

    def ttft_page() -> str:
        # Every request's first token within (0.1 s, 0.25 s], so the P99 is that
        # bucket's interpolation, 0.2485 s, however few scrapes the window holds.
        n = 1.0 + 20 * (time.monotonic() - started)
        return Page(
            counters={"vllm:request_success_total": n},
            histograms={"chunkpilot:time_to_first_token_seconds": ([(0.1, 0.0), (0.25, n), (math.inf, n)], 0.2 * n)},
        ).text()

    async def metrics_app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": ttft_page().encode()})

    viewer = make_user(Role.VIEWER)
    with ThreadedServer(metrics_app) as server:
        pool = Pool.objects.create(name="p3")
        worker = Worker.objects.create(name="gpu-3", url=server.url, pool=pool, state=1)
        target = {
            "targets": [server.url.split("://", 1)[1]],
            "labels": {"worker": worker.name, "pool": pool.name, "cohort": "stable"},
        }
        config = {
            "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms"},
            "scrape_configs": [{"job_name": deploy.WORKERS_JOB, "static_configs": [target]}],
        }
        with prometheus(tmp_path / "prometheus", config) as prom:
            wait_for(
                lambda: prom.query("count_over_time(chunkpilot:time_to_first_token_seconds_count[1m]) >= 3"),
                30,
                "three scrapes by Prometheus",
            )

            async def scenario() -> str:
                comm = socket(f"/ws/metrics/worker/{worker.pk}/?window=1m", viewer)
                connected, _ = await comm.connect()
                assert connected
                assert await database_sync_to_async(tasks.scrape)() == {"targets": 0, "failed": 0}
                html = await comm.receive_from(timeout=10)
                await comm.disconnect()
                return html

            with override_settings(METRICS_BACKEND="prometheus", PROMETHEUS_URL=prom.url):
                html = run(scenario)
    assert not ScrapeRound.objects.exists()  # the control plane scraped nothing: the figures are Prometheus's
    assert html.startswith('<div id="metrics-panel-live" hx-swap-oob="true">')
    chart = json.loads(html.split('id="chart-data-ttft"', 1)[1].split(">", 1)[1].split("</script>", 1)[0])
    (line,) = chart["lines"]
    # The newest point is Prometheus's P99 now; before its first scrape there is no data.
    assert line["label"] == "fleet" and line["values"][-1] == pytest.approx(0.2485)
    assert line["values"][0] is None


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
