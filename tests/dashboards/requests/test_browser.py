"""Headless Chromium against a real ASGI server: from a rollout's page to its
canary's chunked requests, narrowed further with the filter form, then one
request's page with its timeline and gap chart drawn."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.gateway.models import RequestLog
from controlplane.rollouts.models import Rollout
from tests.controlplane.rollouts.factories import make_fleet
from tests.dashboards.support import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_filter_to_a_rollouts_canary_chunked_requests_open_one_and_see_its_timeline(page: Any, web: str) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 2500}, {"pause": {}}],
        gate={"enabled": False},
        actor="tester",
    )
    after = rollout.created + timedelta(seconds=5)

    def log(request_id: str, role: str, split: bool, status: int = 200) -> RequestLog:
        pool = fleet.canary if role == "canary" else fleet.stable
        return RequestLog.objects.create(
            request_id=request_id,
            created_at=after,
            model=fleet.table.model,
            cohort=role,
            pool=pool,
            worker=fleet.workers[role][0],
            status=status,
            prefill_mode="chunked",
            prompt_split=split,
            num_prefill_chunks=3 if split else 1,
            prompt_tokens=900,
            ttft_seconds=0.3,
            max_gap_seconds=0.25,
            e2e_seconds=1.2,
            queue_seconds=0.01,
            prefill_seconds=0.25,
            computed_tokens=900,
            cached_tokens=0,
            preemptions=0,
            stream=True,
            timeline={"chunks": [[0.01, 300], [0.09, 300], [0.17, 300]], "gaps": [0.02, 0.25, 0.03, 0.02]},
        )

    ok = log("canary-chunked-ok", "canary", True)
    failed = log("canary-chunked-failed", "canary", True, status=503)
    whole = log("canary-whole", "canary", False)
    stable = log("stable-chunked", "stable", True)

    sign_in(page, web, Role.VIEWER, f"/rollouts/{rollout.pk}/")
    page.click("#canary-requests")
    rows = page.locator("#request-rows tbody tr")
    expect(rows).to_have_count(2)
    for other in (whole, stable):
        expect(page.locator(f'#request-rows a[href="/requests/{other.pk}/"]')).to_have_count(0)
    # narrow to the ones that succeeded with the form
    page.select_option('select[name="status"]', "ok")
    page.click('#request-filters button[type="submit"]')
    expect(rows).to_have_count(1)
    expect(page.locator(f'#request-rows a[href="/requests/{failed.pk}/"]')).to_have_count(0)
    page.click(f'#request-rows a[href="/requests/{ok.pk}/"]')

    expect(page.locator("h1")).to_contain_text("canary-chunked-ok")
    events = page.locator("#timeline-events tbody tr td:first-child")
    expect(events).to_have_text(
        [
            "arrived",
            "scheduled (left the queue)",
            "prefill chunk 1",
            "prefill chunk 2",
            "prefill chunk 3",
            "first token",
            "ended",
        ]
    )
    expect(page.locator("#timeline line")).to_have_count(1 + 7)  # the axis and one tick per event
    expect(page.locator("#gaps rect")).to_have_count(4)
    box = page.locator("#gaps").bounding_box()
    assert box is not None and box["width"] > 100 and box["height"] > 20  # drawn, not collapsed
    expect(page.locator("#facts")).to_contain_text("yes, 3 chunks")


def test_the_requests_pages_never_scroll_sideways_at_1440_px(browser: Any, web: str) -> None:
    """The filter bar wraps and a wide table scrolls in its own box: the
    page is no wider than the window, and the dark navigation spans it."""
    fleet = make_fleet(num_stable=1, num_canary=1)
    row = RequestLog.objects.create(
        request_id="a-rather-long-request-id-0123456789abcdef",
        created_at=timezone.now(),
        model=fleet.table.model,
        cohort="stable",
        pool=fleet.stable,
        worker=fleet.workers["stable"][0],
        status=200,
        prefill_mode="chunked",
        prompt_split=True,
        num_prefill_chunks=3,
        ttft_seconds=0.1,
        timeline={"chunks": [[0.01, 300], [0.09, 300], [0.17, 300]], "gaps": [0.02, 0.25, 0.03]},
    )
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    try:
        page = context.new_page()
        sign_in(page, web, Role.VIEWER, "/requests/")
        for path in ("/requests/", f"/requests/{row.pk}/"):
            page.goto(f"{web}{path}")
            widths = page.evaluate(
                """() => ({page: document.documentElement.scrollWidth, window: window.innerWidth,
                          nav: document.querySelector('.topbar').getBoundingClientRect().width})"""
            )
            assert widths["page"] <= widths["window"], (path, widths)
            assert widths["nav"] == widths["page"], (path, widths)
    finally:
        context.close()
