"""Every form that a live push can replace still posts after the push.

A partial pushed down a websocket is rendered without a request, so its
``{% csrf_token %}`` is empty: before the fix, a plain form in it answered
403 "CSRF token missing" until the page was reloaded. Each test here opens
the page, makes the server push the form's partial (checking that the
pushed copy carries no token of its own), then submits it and checks the
action took effect.

The forms a push can replace: the experiment's Abort and Adopt
(``experiments/partials/live.html``), the rollout's buttons
(``rollouts/partials/live.html``) and a fleet row's buttons
(``fleet/partials/worker_button.html``)."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.experiments.models import Experiment, Workload
from controlplane.fleet.models import Worker
from controlplane.rollouts.models import Rollout
from tests.controlplane.factories import enroll_worker
from tests.controlplane.rollouts.factories import make_fleet
from tests.dashboards.experiments.test_pages import finished_experiment, lab_worker
from tests.dashboards.support import not_reloaded, sign_in, wait_for_socket

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TOKEN = 'input[name="csrfmiddlewaretoken"]'


def push_experiment(page: Any, exp: Experiment, marker: str) -> None:
    """The runner's kind of change, pushed: the status panel is replaced."""
    Experiment.objects.filter(pk=exp.pk).update(message=marker)
    Experiment.objects.get(pk=exp.pk).changed()
    expect(page.locator("#experiment-live [data-message]")).to_have_text(marker, timeout=15000)
    assert not_reloaded(page), "the panel was replaced by the push, not by a reload"


def test_abort_posts_after_the_status_panel_was_pushed(page: Any, web: str) -> None:
    workload = Workload.from_scenario(name="lt", scenario="long-tail", rate=2.0, duration_seconds=60)
    exp = Experiment.create(name="pushed", workload=workload, workers=[lab_worker()])
    sign_in(page, web, Role.OPERATOR, f"/experiments/{exp.pk}/")
    wait_for_socket(page, f"/ws/experiments/{exp.pk}/")
    push_experiment(page, exp, "arm 1: warming up")
    abort = page.locator('form:has(button[data-button="abort"])')
    expect(abort.locator(TOKEN)).to_have_count(0)  # what the push rendered

    page.once("dialog", lambda dialog: dialog.accept())
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        abort.locator("button").click()
    assert posted.value.status == 302, posted.value.status
    expect(page.locator("body")).to_contain_text("Abort requested")
    assert Experiment.objects.get(pk=exp.pk).abort_requested


def test_adopt_posts_after_the_status_panel_was_pushed(page: Any, web: str) -> None:
    exp = finished_experiment()
    sign_in(page, web, Role.OPERATOR, f"/experiments/{exp.pk}/")
    wait_for_socket(page, f"/ws/experiments/{exp.pk}/")
    push_experiment(page, exp, "finished: see the recommendation")
    adopt = page.locator('form:has(button[data-button="adopt"])')
    expect(adopt.locator(TOKEN)).to_have_count(0)

    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        adopt.locator("button").click()
    assert posted.value.status == 302, posted.value.status
    page.wait_for_url(lambda url: "/rollouts/new/?revision=" in url)
    revision_id = int(page.url.rsplit("=", 1)[1])
    assert Experiment.objects.get(pk=exp.pk).recommendation["winner"]
    from controlplane.profiles.models import ProfileRevision

    assert ProfileRevision.objects.filter(pk=revision_id).exists()


def test_a_rollout_button_posts_after_the_live_part_was_pushed(page: Any, web: str) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    r = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 2500}, {"pause": {}}],
        gate={"enabled": False},
        actor="tester",
    )
    sign_in(page, web, Role.OPERATOR, f"/rollouts/{r.pk}/")
    wait_for_socket(page, f"/ws/rollouts/{r.pk}/")
    # a push: the reconciler's kind of change, seen as a new message
    page.evaluate("document.querySelector('#rollout-live').dataset.beforePush = '1'")
    Rollout.objects.get(pk=r.pk).changed()
    expect(page.locator("#rollout-live")).not_to_have_attribute("data-before-push", "1", timeout=15000)
    assert not_reloaded(page)
    abort = page.locator('form:has(button[data-action="abort"])')
    expect(abort.locator(TOKEN)).to_have_count(0)

    abort.locator('input[name="reason"]').fill("after a push")
    page.once("dialog", lambda dialog: dialog.accept())
    with page.expect_response(lambda resp: resp.request.method == "POST") as posted:
        abort.locator("button").click()
    assert posted.value.status == 200, posted.value.status
    rollout = Rollout.objects.get(pk=r.pk)
    assert rollout.abort_requested and "after a push" in rollout.abort_reason


def test_a_worker_button_posts_after_its_row_was_pushed(page: Any, web: str) -> None:
    worker, _ = enroll_worker("pushed-1")
    sign_in(page, web, Role.OPERATOR, "/")
    wait_for_socket(page, "/ws/fleet/")
    row = page.locator(f"#worker-{worker.pk}")
    expect(row).to_have_attribute("data-state", "registering")
    Worker.objects.get(pk=worker.pk).flag_action("cordon", None)  # someone else; pushes the row
    expect(row.get_by_role("button", name="uncordon")).to_be_visible(timeout=15000)
    assert not_reloaded(page)
    drain = row.locator('form:has(button:text-is("drain"))')
    expect(drain.locator(TOKEN)).to_have_count(0)

    with page.expect_response(lambda resp: resp.request.method == "POST") as posted:
        drain.locator("button").click()
    assert posted.value.status == 200, posted.value.status
    expect(row).to_contain_text("drain requested")
    assert Worker.objects.get(pk=worker.pk).drain_requested
