"""Headless Chromium against a real ASGI server: "test now" in the rule
editor shows the current value without leaving the page, and the banner
appears on a page already open when a critical alert starts firing."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.alerts import defaults
from controlplane.alerts.models import AlertRule
from controlplane.fleet.health import State as WorkerState
from controlplane.fleet.models import Worker
from tests.controlplane.alerts.support import firing_alert
from tests.controlplane.factories import enroll_worker, make_pool, make_user

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def sign_in(page: Any, base: str, role: Role, next_path: str) -> None:
    make_user(role, username=f"alerts-{role.group_name}", password="pw-alerts")
    page.goto(f"{base}/login/?next={next_path}")
    page.fill("#id_username", f"alerts-{role.group_name}")
    page.fill("#id_password", "pw-alerts")
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}{next_path}")


def test_test_now_shows_each_workers_value_in_place(page: Any, web: str) -> None:
    defaults.install(AlertRule)
    pool = make_pool("gpu-a")
    for name in ("w1", "w2"):
        enroll_worker(name, pool=pool)
    Worker.objects.filter(name="w2").update(state=WorkerState.OFFLINE)
    rule = AlertRule.objects.get(key="worker-missing")
    path = f"/alerts/rules/{rule.pk}/"
    sign_in(page, web, Role.OPERATOR, path)
    page.evaluate("window.notReloaded = true")
    page.get_by_role("button", name="Test now").click()
    groups = page.locator("#test-groups")
    expect(groups).to_be_visible(timeout=10000)
    expect(groups.locator("tr", has_text="w2").locator(".test-value")).to_have_text("1")
    expect(groups.locator("tr", has_text="w2")).to_contain_text("holds")
    expect(groups.locator("tr", has_text="w1")).to_contain_text("clear")
    assert page.evaluate("window.notReloaded") is True, "the result came in place"


def test_the_banner_appears_on_an_open_page_when_a_critical_alert_fires(page: Any, web: str) -> None:
    sign_in(page, web, Role.VIEWER, "/profiles/")
    expect(page.locator(".alert-banner")).to_have_count(0)
    firing_alert({"alertname": "ErrorRateHigh", "pool": "gpu-a", "severity": "critical"}, timezone.now())
    # The banner polls every 15 s.
    expect(page.locator(".alert-banner")).to_contain_text("ErrorRateHigh", timeout=25000)
    page.locator(".alert-banner a").click()
    page.wait_for_url(f"{web}/alerts/")
    expect(page.locator("#active-table")).to_contain_text("ErrorRateHigh")
