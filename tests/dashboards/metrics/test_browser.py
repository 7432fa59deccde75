"""Headless Chromium against a real ASGI server process: the four-figure
panel draws its uPlot charts from stored scrapes, and when a new scrape
arrives the charts and the table take the new figures in place."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from playwright.sync_api import expect

from controlplane import live
from controlplane.accounts.roles import Role
from controlplane.fleet.models import Pool, Worker
from tests.controlplane.metrics.pages import Page, job, store
from tests.dashboards.support import not_reloaded, sign_in, wait_for_socket

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TTFT = "chunkpilot:time_to_first_token_seconds"
CHARTS = ("ttft", "memory", "prefill_wait", "kv_fragmentation")


def ttft_page(fast: float, slow: float) -> Page:
    """Cumulative TTFT buckets: ``fast`` requests under 0.1 s, ``slow`` in (1, 2.5]."""
    total = fast + slow
    return Page(
        counters={
            "chunkpilot:memory_byte_seconds_total": 1e9 + 4e6 * fast,
            "chunkpilot:kv_fragmentation_ratio_seconds_total": 0.0,
        },  # a flat 0%
        histograms={TTFT: ([(0.1, fast), (1.0, fast), (2.5, total), (float("inf"), total)], 0.05 * fast + 2 * slow)},
        gauges={"chunkpilot:memory_recent_peak_bytes": 3e6},
    )


def chart_state(page: Any, chart: str) -> Any:
    return page.evaluate(
        """(id) => { const c = window.chunkpilotCharts[id];
                     const v = c.payload.lines[0].values; return {points: v.length, last: v[v.length - 1]}; }""",
        chart,
    )


def test_the_panel_draws_its_charts_and_updates_them_when_a_scrape_arrives(page: Any, web: str) -> None:
    w = Worker.objects.create(name="gpu-1", url="http://gpu-1.invalid", pool=Pool.objects.create(name="p1"))
    j = job(w, "stable")
    now = timezone.now()
    for i in range(24):  # the last two minutes, every 5 s: 10 fast requests each
        store(now - timedelta(seconds=115 - 5 * i), {j: ttft_page(1000 + 10 * i, 0)})

    sign_in(page, web, Role.VIEWER, "/figures/panel/?group_by=cohort&range=15m&window=1m")
    wait_for_socket(page, "/ws/metrics/panel/")

    for chart in CHARTS:
        expect(page.locator(f"#chart-{chart} canvas")).to_have_count(1)
        expect(page.locator(f"#chart-{chart}")).to_have_attribute("data-updates", "1")
    # A flat 0% series gets a small band of its own, not uPlot's 0..100 (10000%).
    flat = page.evaluate("""() => { const c = window.chunkpilotCharts['kv_fragmentation'];
                                    return {values: c.payload.lines[0].values, max: c.plot.scales.y.max}; }""")
    assert {v for v in flat["values"] if v is not None} == {0} and 0 < flat["max"] <= 0.02, flat
    before = chart_state(page, "ttft")
    assert before["points"] == 16 and before["last"] == pytest.approx(0.099, rel=1e-6)
    cell = page.locator('tr[data-group="stable"] td[data-figure="ttft_p99"] .figure-value')
    expect(cell).to_have_text("99 ms")
    # ... with the samples it rests on: 10 requests a scrape, 12 scrapes in the minute.
    expect(page.locator('tr[data-group="stable"] td[data-figure="ttft_p99"] .samples')).to_have_text("n = 120")

    # A new round: 50 slow requests since the last scrape. The scraper stores
    # it and publishes the round; the server pushes the partial.
    store(timezone.now(), {j: ttft_page(1000 + 10 * 23, 50)})

    # From another thread, as from the Celery worker: Playwright's event loop runs in this one.
    def notify() -> None:
        try:
            live.publish(live.Event.METRICS_SCRAPED, scopes=[w.pk], at=timezone.now().timestamp(), worker_ids=[w.pk])
        finally:
            connection.close()  # the thread's own connection, or the test database cannot be dropped

    sender = threading.Thread(target=notify)
    sender.start()
    sender.join(10)

    expect(page.locator("#chart-ttft")).to_have_attribute("data-updates", "2", timeout=10000)
    after = chart_state(page, "ttft")
    assert after["last"] > 1.0, after  # the slow requests lifted the P99 into (1, 2.5]
    expect(cell).not_to_have_text("99 ms")
    expect(page.locator("#chart-ttft canvas")).to_have_count(1)  # updated in place, not redrawn beside
    assert not_reloaded(page)


def test_a_rollout_step_is_marked_on_every_chart_and_one_crosshair_spans_them(page: Any, web: str) -> None:
    from controlplane.rollouts.models import Rollout
    from tests.controlplane.rollouts.factories import make_fleet

    fleet = make_fleet(num_stable=1, num_canary=1)
    w = fleet.workers["stable"][0]
    now = timezone.now()
    for i in range(60):  # the last five minutes, every 5 s
        store(now - timedelta(seconds=295 - 5 * i), {job(w, "stable"): ttft_page(1000 + 10 * i, 0)})
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )
    rollout.record("weights_set", "weights set: canary 10%", now=now - timedelta(seconds=120))

    sign_in(page, web, Role.VIEWER, "/figures/panel/?group_by=cohort&range=15m&window=1m")
    for chart in CHARTS:
        step = page.locator(f'#chart-{chart} .annotation[data-kind="rollout-step"]')
        expect(step.first).to_be_attached()
    titles = page.locator('#chart-ttft .annotation[data-kind="rollout-step"]').evaluate_all(
        "marks => marks.map(m => m.title)"
    )
    assert any(f"rollout {rollout.pk}: weights set: canary 10%" in t for t in titles), titles

    # Hover one chart: the others' cursors move to the same instant.
    box = page.locator("#chart-ttft .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2)
    cursors = page.evaluate(
        "() => Object.fromEntries(Object.entries(window.chunkpilotCharts).map(([id, c]) => [id, c.plot.cursor.left]))"
    )
    lefts = {round(v) for v in cursors.values()}
    assert len(lefts) == 1 and lefts.pop() > 0, cursors
