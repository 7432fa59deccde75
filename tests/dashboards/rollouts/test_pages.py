"""The rollout pages rendered by Django: list, detail with its verdicts and
charts' data, buttons (flags only), and "New rollout" with the default plan."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.rollouts.models import AnalysisRun, Measurement, Rollout
from tests.controlplane.rollouts.factories import Fleet, make_fleet

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(db: Any) -> Fleet:
    return make_fleet(num_stable=2, num_canary=1)


def rollout_of(fleet: Fleet) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )


def test_the_list_shows_each_rollout_with_its_phase(fleet, viewer_client: Client) -> None:
    r = rollout_of(fleet)
    page = viewer_client.get("/rollouts/")
    assert page.status_code == 200
    html = page.content.decode()
    assert f'data-rollout="{r.pk}"' in html and 'data-phase="pending"' in html
    assert 'ws-connect="/ws/rollouts/"' in html
    assert "New rollout" not in html  # viewers cannot start one


def test_the_detail_shows_steps_weights_timeline_and_verdicts_with_chart_data(fleet, operator_client: Client) -> None:
    r = rollout_of(fleet)
    now = timezone.now()
    run = AnalysisRun.objects.create(
        rollout=r,
        attempt=1,
        step_index=1,
        template_name="default",
        canary_pool_name=fleet.canary.name,
        baseline_pool_name=fleet.stable.name,
        started_at=now,
        phase=5,
        message="ttft: 1 failed > 0",
        spec={"metrics": [{"name": "ttft", "figure": "client_ttft_p99"}], "count": 3, "interval_seconds": 30},
    )
    Measurement.objects.create(
        run=run,
        taken_at=now + timedelta(seconds=30),
        window_seconds=30,
        phase=5,
        verdicts=[
            {
                "metric": "ttft",
                "figure": "client_ttft_p99",
                "phase": "failed",
                "canary": 0.91,
                "baseline": 0.2,
                "canary_samples": 40,
                "baseline_samples": 300,
                "ratio": 4.55,
                "reason": "canary 4.55× the baseline > 1.5×",
            }
        ],
    )
    page = operator_client.get(f"/rollouts/{r.pk}/")
    html = page.content.decode()
    assert page.status_code == 200
    assert "set canary weight to 10%" in html and "analysis (default)" in html
    assert 'data-role="stable"' in html and 'data-weight="10000"' in html
    assert 'data-kind="created"' in html
    assert 'data-verdict="failed"' in html and "4.55×" in html and "40 / 300" in html
    assert "uPlot.iife.min.js" in html
    script = re.search(rf'<script id="chart-data-run-{run.pk}-ttft"[^>]*>(.*?)</script>', html, re.S)
    assert script, "the chart's data is in the page"
    data = json.loads(script.group(1))
    assert data["lines"][0]["values"] == [0.91] and data["lines"][1]["values"] == [0.2]
    # buttons that fit a pending rollout, each asking for confirmation
    for verb in ("abort", "promote-full"):
        assert f'data-action="{verb}"' in html
    assert 'data-action="retry"' not in html and 'hx-confirm="Abort this rollout?' in html


def test_the_detail_shows_the_models_output_cap(fleet, viewer_client: Client) -> None:
    r = rollout_of(fleet)
    assert 'data-output-cap="">no output cap' in viewer_client.get(f"/rollouts/{r.pk}/").content.decode()
    fleet.table.set_output_cap(512, actor="tester")
    html = viewer_client.get(f"/rollouts/{r.pk}/").content.decode()
    assert 'data-output-cap="512">output capped at 512 tokens a request' in html


def test_the_live_partial_is_served_alone_for_htmx(fleet, viewer_client: Client) -> None:
    r = rollout_of(fleet)
    page = viewer_client.get(f"/rollouts/{r.pk}/", HTTP_HX_REQUEST="true")
    html = page.content.decode()
    assert html.lstrip().startswith('<div id="rollout-live"') and "<html" not in html


def test_the_abort_button_sets_the_flag_and_redirects(fleet, operator_client: Client) -> None:
    r = rollout_of(fleet)
    reply = operator_client.post(f"/rollouts/{r.pk}/abort/", {"reason": "from the page"})
    assert reply.status_code == 302 and reply["Location"] == f"/rollouts/{r.pk}/"
    r.refresh_from_db()
    assert r.abort_requested and "from the page" in r.abort_reason
    assert AuditEvent.objects.get(action="rollout.abort").after["source"] == "ui"


def test_viewers_cannot_press_buttons(fleet, viewer_client: Client) -> None:
    r = rollout_of(fleet)
    assert viewer_client.post(f"/rollouts/{r.pk}/abort/").status_code == 403
    assert not Rollout.objects.get(pk=r.pk).abort_requested


def test_new_rollout_from_a_profile_revision_uses_the_default_plan(fleet, operator_client: Client) -> None:
    form = operator_client.get(f"/rollouts/new/?revision={fleet.target_revision.pk}")
    html = form.content.decode()
    assert form.status_code == 200
    assert "10% → " in html.replace("set canary weight to ", "") or "set canary weight to 10%" in html
    assert f'value="{fleet.target_revision.pk}" selected' in html
    reply = operator_client.post(
        "/rollouts/new/",
        {
            "target_revision": fleet.target_revision.pk,
            "model": fleet.table.model,
            "stable_pool": fleet.stable.name,
            "canary_pool": fleet.canary.name,
            "progress_deadline_seconds": 600,
            "gate_enabled": "on",
        },
    )
    r = Rollout.objects.get()
    assert reply.status_code == 302 and reply["Location"] == f"/rollouts/{r.pk}/"
    assert len(r.steps) == 7 and r.gate_status == "pending"


def test_new_rollout_shows_field_errors(fleet, operator_client: Client) -> None:
    reply = operator_client.post(
        "/rollouts/new/",
        {
            "target_revision": fleet.target_revision.pk,
            "model": fleet.table.model,
            "stable_pool": fleet.canary.name,
            "canary_pool": fleet.stable.name,
            "progress_deadline_seconds": 600,
        },
    )
    html = reply.content.decode()
    assert reply.status_code == 200
    assert 'data-field-error="canary_pool"' in html and 'data-field-error="stable_pool"' in html
    assert not Rollout.objects.exists()


def test_an_htmx_button_answers_with_the_live_part(fleet, operator_client: Client) -> None:
    r = rollout_of(fleet)
    reply = operator_client.post(f"/rollouts/{r.pk}/promote/", HTTP_HX_REQUEST="true")
    html = reply.content.decode()
    assert reply.status_code == 200 and html.lstrip().startswith('<div id="rollout-live"')
    assert "cannot promote a rollout that is pending" in html and 'class="error"' in html


def test_the_roll_back_button_starts_a_fast_tracked_rollout_and_opens_it(fleet, operator_client: Client) -> None:
    r = rollout_of(fleet)
    Rollout.objects.filter(pk=r.pk).update(phase=Rollout.Phase.SUCCEEDED)
    html = operator_client.get(f"/rollouts/{r.pk}/").content.decode()
    assert f'action="/rollouts/{r.pk}/rollback/"' in html and "Roll back" in html
    assert f'action="/rollouts/{r.pk}/abort/"' not in html  # a finished rollout has nothing to abort
    reply = operator_client.post(f"/rollouts/{r.pk}/rollback/")
    back = Rollout.objects.exclude(pk=r.pk).get()
    assert reply.status_code == 302 and reply["Location"] == f"/rollouts/{back.pk}/"
    assert back.fast_track and back.rollback_of_id == r.pk and back.steps == []
    assert (back.stable_revision_id, back.target_revision_id) == (fleet.target_revision.pk, fleet.stable_revision.pk)
    audit = AuditEvent.objects.get(action="rollout.rollback")
    assert audit.object_id == str(back.pk) and audit.actor_repr.startswith("operator")
    page = operator_client.get(reply["Location"]).content.decode()
    assert f"Rollback started: rollout {back.pk}." in page


def test_the_roll_back_button_from_htmx_navigates_to_the_new_rollout(fleet, operator_client: Client) -> None:
    r = rollout_of(fleet)
    Rollout.objects.filter(pk=r.pk).update(phase=Rollout.Phase.SUCCEEDED)
    reply = operator_client.post(f"/rollouts/{r.pk}/rollback/", HTTP_HX_REQUEST="true")
    back = Rollout.objects.exclude(pk=r.pk).get()
    assert reply.status_code == 204 and reply["HX-Redirect"] == f"/rollouts/{back.pk}/"


def test_the_roll_back_button_on_a_running_rollout_is_refused_and_says_why(fleet, operator_client: Client) -> None:
    r = rollout_of(fleet)
    reply = operator_client.post(f"/rollouts/{r.pk}/rollback/", follow=True)
    assert "only a succeeded rollout can be rolled back" in reply.content.decode()
    assert Rollout.objects.count() == 1 and not AuditEvent.objects.filter(action="rollout.rollback").exists()


def test_a_profile_page_links_each_revision_to_a_new_rollout_for_operators(fleet, operator_client: Client) -> None:
    profile = fleet.target_revision.profile
    html = operator_client.get(f"/profiles/{profile.pk}/").content.decode()
    assert (
        f'href="/rollouts/new/?revision={fleet.target_revision.pk}" data-rollout-revision='
        f'"{fleet.target_revision.pk}">Roll out this revision</a>'
    ) in html  # the latest, at the top
    assert f'href="/rollouts/new/?revision={fleet.stable_revision.pk}"' in html  # and each revision's row
    # the link opens the form with that revision chosen
    form = operator_client.get(f"/rollouts/new/?revision={fleet.stable_revision.pk}").content.decode()
    assert f'value="{fleet.stable_revision.pk}" selected' in form


def test_a_profile_page_offers_viewers_no_rollout(fleet, viewer_client: Client) -> None:
    html = viewer_client.get(f"/profiles/{fleet.target_revision.profile.pk}/").content.decode()
    assert "/rollouts/new/" not in html and "Roll out this revision" not in html
