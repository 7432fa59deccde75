"""Headless Chromium against a real ASGI server: "test now" in the rule
editor shows the current value without leaving the page, and, pushed over
the websocket well before the slow poll behind it (every 30 s), a new alert
appears on the open alerts page and the banner on any open page."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.alerts import defaults, evaluation
from controlplane.alerts.models import AlertRule
from controlplane.alerts.notify import notify_event
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, make_pool
from tests.dashboards.support import not_reloaded, sign_in, wait_for_socket

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
PUSHED_WITHIN_MS = 10000  # a third of the poll's period: only the push is that quick


def test_test_now_shows_each_workers_value_in_place(page: Any, web: str) -> None:
    defaults.install(AlertRule)
    pool = make_pool("gpu-a")
    for name in ("w1", "w2"):
        enroll_worker(name, pool=pool)
    Worker.objects.filter(name="w2").update(state=WorkerState.OFFLINE)
    rule = AlertRule.objects.get(key="worker-missing")
    path = f"/alerts/rules/{rule.pk}/"
    sign_in(page, web, Role.OPERATOR, path)
    wait_for_socket(page, "/ws/alerts/banner/")
    page.get_by_role("button", name="Test now").click()
    groups = page.locator("#test-groups")
    expect(groups).to_be_visible(timeout=10000)
    expect(groups.locator("tr", has_text="w2").locator(".test-value")).to_have_text("1")
    expect(groups.locator("tr", has_text="w2")).to_contain_text("holds")
    expect(groups.locator("tr", has_text="w1")).to_contain_text("clear")
    assert not_reloaded(page), "the result came in place"


def test_the_banner_appears_on_an_open_page_when_a_critical_alert_fires(page: Any, web: str) -> None:
    sign_in(page, web, Role.VIEWER, "/profiles/")
    wait_for_socket(page, "/ws/alerts/banner/")
    expect(page.locator(".alert-banner")).to_have_count(0)
    notify_event("ErrorRateHigh", labels={"pool": "gpu-a"}, severity="critical")
    expect(page.locator(".alert-banner")).to_contain_text("ErrorRateHigh", timeout=PUSHED_WITHIN_MS)
    assert not_reloaded(page)
    page.locator(".alert-banner a").click()
    page.wait_for_url(f"{web}/alerts/")
    expect(page.locator("#active-table")).to_contain_text("ErrorRateHigh")


def test_a_new_alert_appears_on_the_open_alerts_page_without_a_reload(page: Any, web: str) -> None:
    AlertRule.objects.update(enabled=False)  # the shipped rules: only this test's own evaluates
    enroll_worker("w1", pool=make_pool("gpu-a"))
    Worker.objects.filter(name="w1").update(state=WorkerState.OFFLINE)
    AlertRule.objects.create(
        name="GpuGone",
        figure="worker_missing",
        group_by="worker",
        window_seconds=60,
        threshold=0,
        severity="critical",
        no_data_state="ok",
    )
    sign_in(page, web, Role.VIEWER, "/alerts/")
    wait_for_socket(page, "/ws/alerts/", "/ws/alerts/banner/")
    table = page.locator("#active-table")
    expect(table).to_contain_text("Nothing is firing")

    # The Celery task's cycle, from another thread: Playwright's event loop runs in this one.
    def evaluate() -> None:
        try:
            evaluation.evaluate()
        finally:
            connection.close()  # the thread's own connection, or the test database cannot be dropped

    evaluator = threading.Thread(target=evaluate)
    evaluator.start()
    evaluator.join(30)

    expect(table.locator("tr.alert-firing")).to_contain_text("GpuGone", timeout=PUSHED_WITHIN_MS)
    expect(page.locator(".alert-banner")).to_contain_text("GpuGone")
    expect(page.locator("#critical-count .badge")).to_have_text("1")
    assert not_reloaded(page)
