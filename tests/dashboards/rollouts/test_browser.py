"""Headless Chromium against a real ASGI server and a real Celery worker:
the rollout page follows the reconciler live over the websocket, its
buttons ask before they act, and verdict charts are drawn."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import AnalysisRun, Measurement, Rollout
from tests.controlplane.rollouts.factories import Agents, make_fleet
from tests.dashboards.support import not_reloaded, sign_in, wait_for_socket
from tests.support import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_rollout_page_follows_the_reconciler_live_and_buttons_confirm(page: Any, web: str, celery_worker) -> None:
    fleet = make_fleet(num_stable=2, num_canary=1)
    with Agents(fleet):
        r = Rollout.start(
            routing_table=fleet.table,
            stable_pool=fleet.stable,
            canary_pool=fleet.canary,
            target_revision=fleet.target_revision,
            steps=[{"set_weight": 2500}, {"pause": {}}],
            gate={"enabled": False},
            actor="tester",
        )
        wait_until(lambda: Rollout.objects.get(pk=r.pk).phase == Phase.PAUSED, what="paused")
        sign_in(page, web, Role.OPERATOR, f"/rollouts/{r.pk}/")
        wait_for_socket(page, f"/ws/rollouts/{r.pk}/")
        live = page.locator("#rollout-live")
        expect(live).to_have_attribute("data-phase", "paused")
        expect(page.locator('#rollout-weights tr[data-role="canary"] [data-weight]')).to_have_attribute(
            "data-weight", "2500"
        )

        # someone else aborts (the API, the kill switch): this page follows without a reload
        abort = threading.Thread(
            target=lambda: (
                Rollout.objects.get(pk=r.pk).request_abort("someone-else", "from elsewhere", source="api"),
                connection.close(),
            )
        )
        abort.start()  # off the thread Playwright's event loop runs in
        abort.join(10)
        expect(live).to_have_attribute("data-phase", "aborted", timeout=30000)
        expect(page.locator('#rollout-timeline tr[data-kind="aborted"]')).to_have_count(1)
        expect(page.locator('#rollout-weights tr[data-role="canary"] [data-weight]')).to_have_attribute(
            "data-weight", "0"
        )
        assert not_reloaded(page), "updated in place"

        # a button asks first; dismissing it changes nothing
        retry = page.locator('button[data-action="retry"]')
        page.once("dialog", lambda dialog: dialog.dismiss())
        retry.click()
        assert not Rollout.objects.get(pk=r.pk).retry_requested
        # accepting it sets the flag; the reconciler does the rest, pushed live
        messages: list[str] = []
        page.once("dialog", lambda dialog: (messages.append(dialog.message), dialog.accept()))
        retry.click()
        # (the button's own answer may be overtaken at once by the reconciler's push)
        wait_until(lambda: messages, what="the confirmation")
        assert "from its first step" in messages[0]
        expect(page.locator("#rollout-live")).to_have_attribute("data-phase", "paused", timeout=30000)
        assert Rollout.objects.get(pk=r.pk).attempt == 2
        assert not_reloaded(page), "buttons and pushes swap the live part in place"


def test_each_verdict_is_charted_canary_against_baseline(page: Any, web: str) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    r = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )
    now = timezone.now()
    run = AnalysisRun.objects.create(
        rollout=r,
        attempt=1,
        step_index=1,
        template_name="default",
        canary_pool_name=fleet.canary.name,
        baseline_pool_name=fleet.stable.name,
        started_at=now,
        phase=2,
        message="all 1 metrics passed",
        spec={"metrics": [{"name": "ttft", "figure": "client_ttft_p99"}], "count": 2, "interval_seconds": 30},
    )
    for i, (c, b) in enumerate([(0.31, 0.30), (0.33, 0.29)]):
        Measurement.objects.create(
            run=run,
            taken_at=now + timedelta(seconds=30 * (i + 1)),
            window_seconds=30,
            phase=2,
            verdicts=[
                {
                    "metric": "ttft",
                    "phase": "successful",
                    "canary": c,
                    "baseline": b,
                    "canary_samples": 50,
                    "baseline_samples": 400,
                    "ratio": c / b,
                    "reason": "within",
                }
            ],
        )
    sign_in(page, web, Role.VIEWER, f"/rollouts/{r.pk}/")
    chart = page.locator(f"#chart-run-{run.pk}-ttft")
    expect(chart.locator("canvas")).to_have_count(1)
    expect(chart).to_contain_text(f"canary ({fleet.canary.name})")
    expect(chart).to_contain_text(f"baseline ({fleet.stable.name})")
    expect(page.locator('.analysis-run [data-verdict="successful"]')).to_have_count(1)
    assert page.locator("button[data-action]").count() == 0  # viewers see no buttons


def test_a_run_with_one_measurement_spans_minutes_from_zero_with_distinct_ticks(page: Any, web: str) -> None:
    """One point: uPlot alone spans years of time and a hair of value."""
    fleet = make_fleet(num_stable=1, num_canary=1)
    r = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )
    now = timezone.now()
    run = AnalysisRun.objects.create(
        rollout=r,
        attempt=1,
        step_index=1,
        template_name="default",
        canary_pool_name="canary",
        baseline_pool_name="baseline",
        started_at=now,
        phase=1,
        spec={"metrics": [{"name": "ttft", "figure": "client_ttft_p99"}], "count": 2, "interval_seconds": 30},
    )
    verdict = {"metric": "ttft", "phase": "successful", "canary": 0.00992, "baseline": 0.00991, "reason": "within"}
    Measurement.objects.create(run=run, taken_at=now, window_seconds=30, phase=2, verdicts=[verdict])
    sign_in(page, web, Role.VIEWER, f"/rollouts/{r.pk}/")
    chart = page.locator(f"#chart-run-{run.pk}-ttft")
    expect(chart.locator("canvas")).to_have_count(1)
    state = page.evaluate(
        """(id) => { const u = window.chunkpilotCharts[id].plot;
                     return {x: [u.scales.x.min, u.scales.x.max], y: [u.scales.y.min, u.scales.y.max],
                             ticks: u.axes[1]._values, labels: u.series.slice(1).map(s => s.label)}; }""",
        f"run-{run.pk}-ttft",
    )
    assert 0 < state["x"][1] - state["x"][0] <= 600, state  # minutes, not years
    assert state["y"][0] == 0 and 0.00992 < state["y"][1] <= 0.02, state
    assert len(set(state["ticks"])) == len(state["ticks"]) >= 3, state
    assert state["labels"] == ["canary", "baseline"]  # not "canary canary"
