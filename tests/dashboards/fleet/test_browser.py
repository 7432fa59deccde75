"""Headless Chromium against a real ASGI server process: the fleet page
changes in place, over the websocket, when a heartbeat or the health sweep
changes a worker's state."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
import time_machine
from django.utils import timezone
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_pool
from tests.dashboards.support import not_reloaded, sign_in, wait_for_socket
from workers.contract import HEARTBEAT_PATH

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def open_fleet(page: Any, base: str, role: Role) -> None:
    sign_in(page, base, role, "/")
    wait_for_socket(page, "/ws/fleet/")


def test_a_heartbeat_that_changes_state_updates_the_fleet_page_live(page: Any, web: str) -> None:
    worker, secret = enroll_worker("live-1", pool=make_pool("live"))
    open_fleet(page, web, Role.VIEWER)
    row = page.locator(f"#worker-{worker.pk}")
    expect(row).to_have_attribute("data-state", "registering")

    reply = httpx.post(
        f"{web}{HEARTBEAT_PATH}", json=heartbeat_request("ready"), headers={"Authorization": f"Bearer {secret}"}
    )
    assert reply.status_code == 200
    expect(row).to_have_attribute("data-state", "ready", timeout=10000)
    expect(row.get_by_test_id("state")).to_have_text("ready")
    expect(page.locator("#fleet-summary")).to_contain_text("1 ready")

    reply = httpx.post(
        f"{web}{HEARTBEAT_PATH}", json=heartbeat_request("draining"), headers={"Authorization": f"Bearer {secret}"}
    )
    expect(row).to_have_attribute("data-state", "draining", timeout=10000)
    assert not_reloaded(page), "the page was updated in place"


def test_a_dropped_live_socket_retries_within_ten_seconds_and_a_gone_one_pauses_nothing(page: Any, web: str) -> None:
    open_fleet(page, web, Role.VIEWER)
    delays = page.evaluate("Array.from({length: 300}, (_, i) => htmx.config.wsReconnectDelay(i % 30))")
    assert 0 <= min(delays) and max(delays) <= 10000, "capped at 10 s, not htmx's 64 s"
    assert max(delays) > 5000, "still full jitter: a fleet of browsers spreads its retries"
    banner = page.locator("#live-paused")
    expect(banner).to_be_hidden()
    # A socket's element closes for a reason htmx reconnects on: paused; the element
    # then leaves the page (swapped out, never to open again): nothing is paused.
    page.evaluate(
        """() => {
        const el = document.createElement("div");
        el.id = "gone-socket";
        document.body.appendChild(el);
        el.dispatchEvent(new CustomEvent("htmx:wsClose", {bubbles: true, detail: {event: {code: 1013}}}));
    }"""
    )
    expect(banner).to_be_visible()
    page.evaluate(
        """() => {
        document.getElementById("gone-socket").remove();
        document.body.dispatchEvent(new CustomEvent("htmx:afterSettle", {bubbles: true}));
    }"""
    )
    expect(banner).to_be_hidden()


def test_the_health_sweep_marks_a_silent_worker_unhealthy_on_the_page(page: Any, web: str) -> None:
    worker, secret = enroll_worker("live-2")
    httpx.post(f"{web}{HEARTBEAT_PATH}", json=heartbeat_request("ready"), headers={"Authorization": f"Bearer {secret}"})
    open_fleet(page, web, Role.VIEWER)
    row = page.locator(f"#worker-{worker.pk}")
    expect(row).to_have_attribute("data-state", "ready")
    with time_machine.travel(timezone.now() + timedelta(seconds=30)):
        assert Worker.sweep_liveness()  # this process; the push crosses Redis to the server
    expect(row).to_have_attribute("data-state", "unhealthy", timeout=10000)


def test_an_operator_drains_from_the_row_and_a_new_worker_appears(page: Any, web: str) -> None:
    worker, _ = enroll_worker("live-3")
    open_fleet(page, web, Role.OPERATOR)
    row = page.locator(f"#worker-{worker.pk}")
    row.get_by_role("button", name="drain").click()
    expect(row).to_contain_text("drain requested")
    assert Worker.objects.get(pk=worker.pk).drain_requested
    newcomer, _ = enroll_worker("live-4")
    expect(page.locator(f"#worker-{newcomer.pk}")).to_have_attribute("data-state", "registering", timeout=10000)
    assert not_reloaded(page)
