"""Headless Chromium at a laptop's 1440 px: no page scrolls sideways. A wide
table scrolls in its own box (``.table-scroll``); filters and choices wrap."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.accounts.roles import Role
from controlplane.gateway.models import RequestLog
from tests.dashboards.support import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTH = 1440


def log_requests() -> None:
    now = timezone.now()
    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=f"wide-{i}",
                created_at=now - timedelta(seconds=10 + i),
                model="a-model-with-a-rather-long-name-as-hugging-face-names-are",
                cohort="canary" if i % 2 else "stable",
                status=200,
                prefill_mode="chunked",
                prompt_split=True,
                num_prefill_chunks=3,
                prompt_tokens=90_000,
                cached_tokens=4096,
                output_tokens=512,
                ttft_seconds=1.234,
                max_gap_seconds=0.5,
                tpot_seconds=0.02,
                e2e_seconds=12.5,
                queue_seconds=0.25,
                prefill_seconds=1.0,
            )
            for i in range(20)
        ]
    )


PATHS = (
    "/requests/",
    "/figures/lengths/",
    "/figures/panel/",
    "/figures/cohorts/",
    "/figures/",
    "/",
    "/audit/",
    "/rollouts/",
    "/experiments/",
    "/alerts/",
    "/advisor/",
)


@pytest.mark.parametrize("path", PATHS)
def test_the_page_fits_1440_px_without_sideways_scrolling(page: Any, web: str, path: str) -> None:
    log_requests()
    page.set_viewport_size({"width": WIDTH, "height": 900})
    sign_in(page, web, Role.VIEWER, path)
    page.wait_for_load_state("load")
    widths = page.evaluate(
        """() => ({doc: document.documentElement.scrollWidth, body: document.body.scrollWidth,
                   view: document.documentElement.clientWidth,
                   wide: [...document.querySelectorAll('main *')]
                     .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
                     .slice(0, 5).map(e => e.tagName + '#' + e.id + '.' + e.className + ' '
                                            + Math.round(e.getBoundingClientRect().right))})"""
    )
    assert widths["doc"] <= widths["view"] and widths["body"] <= widths["view"], widths
