"""The alert consumers over the real Redis channel layer: an alert that
changes state in a real evaluation cycle (or a rollout's event) reaches the
open alerts page as its active table, and every page's banner, as htmx
out-of-band swaps."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser
from django.utils import timezone

from controlplane.accounts.roles import Role
from controlplane.alerts import evaluation
from controlplane.alerts.models import AlertRule
from controlplane.alerts.notify import notify_event
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from dashboards.live import FORBIDDEN
from tests.controlplane.factories import enroll_worker, make_pool, make_user
from tests.dashboards.support import run, socket

pytestmark = pytest.mark.django_db(transaction=True)


def gone_workers(*names: str) -> None:
    """Workers the fleet lost (worker_missing is 1 for each), and no rule but
    the test's own: a migration installs the shipped ones."""
    AlertRule.objects.update(enabled=False)
    pool = make_pool("gpu-a")
    for name in names:
        enroll_worker(name, pool=pool)
    Worker.objects.filter(name__in=names).update(state=WorkerState.OFFLINE)


def missing_rule(name: str, severity: str, worker: str = "") -> AlertRule:
    return AlertRule.objects.create(
        name=name,
        figure="worker_missing",
        group_by="worker",
        window_seconds=60,
        threshold=0,
        severity=severity,
        no_data_state="ok",
        selector={"worker": worker} if worker else {},
    )


def test_an_alert_that_starts_firing_is_pushed_to_the_alerts_page() -> None:
    gone_workers("w1")
    missing_rule("GpuGone", "critical")
    viewer = make_user(Role.VIEWER)

    async def scenario() -> str:
        comm = socket("/ws/alerts/", viewer)
        connected, _ = await comm.connect()
        assert connected
        await database_sync_to_async(evaluation.evaluate)()
        html = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return html

    html = run(scenario)
    assert html.startswith('<div id="active-alerts" hx-swap-oob="true"')
    row = html[html.index('class="alert-row alert-firing') :]
    assert "GpuGone" in row and "w1" in row
    assert ">Silence</a>" not in html, "a viewer's push carries no buttons"


def test_the_push_keeps_the_pages_filters_and_the_operators_buttons() -> None:
    gone_workers("w1", "w2")
    missing_rule("GpuGone", "critical", worker="w1")
    missing_rule("GpuQuiet", "warning", worker="w2")
    operator = make_user(Role.OPERATOR)

    async def scenario() -> str:
        comm = socket("/ws/alerts/?severity=critical", operator)
        await comm.connect()
        await database_sync_to_async(evaluation.evaluate)()
        html = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return html

    html = run(scenario)
    assert "GpuGone" in html and "GpuQuiet" not in html
    assert ">Silence</a>" in html
    assert 'hx-get="/alerts/?severity=critical"' in html, "its slow poll keeps the filter too"


def test_the_banner_and_the_nav_count_follow_a_critical_alert_from_firing_to_resolved() -> None:
    gone_workers("w1")
    missing_rule("GpuGone", "critical")
    viewer = make_user(Role.VIEWER)

    def recover_and_evaluate() -> None:
        Worker.objects.filter(name="w1").update(state=WorkerState.READY)
        evaluation.evaluate(now=timezone.now() + timedelta(minutes=5))

    async def scenario() -> list[str]:
        comm = socket("/ws/alerts/banner/", viewer)
        await comm.connect()
        await database_sync_to_async(evaluation.evaluate)()
        messages = [await comm.receive_from(timeout=10), await comm.receive_from(timeout=10)]
        await database_sync_to_async(recover_and_evaluate)()
        messages.append(await comm.receive_from(timeout=10))
        await comm.disconnect()
        return messages

    banner, count, after = run(scenario)
    assert banner.startswith('<div id="critical-banner" hx-swap-oob="true"')
    assert "1 critical alert firing:" in banner and "GpuGone" in banner
    assert count == (
        '<span id="critical-count" hx-swap-oob="true"> <span class="badge severity-critical">1</span></span>'
    )
    assert after.startswith('<div id="critical-banner" hx-swap-oob="true"') and "alert-banner" not in after


def test_a_rollouts_critical_event_raises_the_banner() -> None:
    viewer = make_user(Role.VIEWER)

    async def scenario() -> str:
        comm = socket("/ws/alerts/banner/", viewer)
        await comm.connect()
        await database_sync_to_async(
            lambda: notify_event("RolloutAborted", labels={"rollout": "7"}, severity="critical")
        )()
        html = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return html

    assert "RolloutAborted" in run(scenario)


@pytest.mark.parametrize("path", ["/ws/alerts/", "/ws/alerts/banner/"])
@pytest.mark.parametrize("role", [None, Role.NONE])
def test_visitors_without_a_role_are_refused(path: str, role: Role | None) -> None:
    user = AnonymousUser() if role is None else make_user(role)

    async def scenario() -> tuple[bool, Any]:
        return await socket(path, user).connect()

    assert run(scenario) == (False, FORBIDDEN)
