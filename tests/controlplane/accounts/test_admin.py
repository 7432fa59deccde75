"""Every model of the project's apps has a Django admin that renders: the
list is built from the app registry, so a model added without an admin (or
without a row in ``one_of_everything``) fails here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import Model
from django.test import Client, RequestFactory
from django.utils import timezone

from controlplane import audit
from controlplane.advisor.models import AdvisorReport
from controlplane.fleet.models import EnrollmentToken

pytestmark = pytest.mark.django_db

PROJECT_MODELS: list[type[Model]] = sorted(
    (m for m in apps.get_models() if m._meta.app_config.name.startswith("controlplane.")),
    key=lambda m: m._meta.label_lower,
)
# Written by gateways and the scraper by the hundred thousand a day.
BIG_TABLES = ["gateway.requestlog", "metrics.snapshot", "metrics.rollup"]


def _label(model: type[Model]) -> str:
    return model._meta.label_lower


def _url(model: type[Model], page: str = "") -> str:
    return f"/admin/{model._meta.app_label}/{model._meta.model_name}/{page}"


@pytest.fixture
def one_of_everything(db: Any) -> None:
    """A row of every project model, made the cheap way."""
    from controlplane.alerts.lifecycle import AlertState
    from controlplane.alerts.models import (
        Alert,
        AlertRule,
        AlertTransition,
        Delivery,
        InboundAlert,
        NotificationGroup,
        Receiver,
        Route,
        Silence,
    )
    from controlplane.gateway.models import ClientKey, RequestLog, RoutingPool, RoutingTable
    from controlplane.metrics.models import (
        CounterReset,
        Rollup,
        ScrapeRound,
        ScrapeStatus,
        SeriesLayout,
        ServiceObjectives,
        Snapshot,
        Target,
        pack,
    )
    from controlplane.rollouts.models import (
        AnalysisRun,
        AnalysisTemplate,
        Measurement,
        Rollout,
        RolloutEvent,
    )
    from tests.controlplane.factories import enroll_worker, make_pool, make_profile

    now = timezone.now()
    revision = make_profile("admin-seen")
    target_revision = revision.profile.add_revision({"max_num_batched_tokens": 1024})
    pool, canary = make_pool("admin-p", revision), make_pool("admin-canary", revision)
    worker, _ = enroll_worker("admin-w", pool=pool)
    EnrollmentToken.issue("admin-t")
    audit.record(None, "x.y", worker)

    table = RoutingTable.objects.create(model="admin-model")
    RoutingPool.objects.create(table=table, pool=pool, role="stable", weight_bp=10000)
    key, _ = ClientKey.issue("admin-key")
    RequestLog.objects.create(
        request_id="r1",
        created_at=now,
        model="admin-model",
        cohort="stable",
        pool=pool,
        worker=worker,
        profile_revision=revision,
        api_key=key,
        status=200,
    )

    layout = SeriesLayout.objects.create(digest="admin", keys=["a"])
    target = Target.objects.create(
        worker=worker,
        worker_name=worker.name,
        pool_name=pool.name,
        layout=layout,
        first_at=now,
        last_at=now,
        last_raw=pack([1.0]),
        offsets=pack([0.0]),
    )
    Snapshot.objects.create(target=target, ts=now, seq=1, values=pack([1.0]))
    Rollup.objects.create(target=target, minute=now, last_ts=now, seq=1, num_samples=1, values=pack([1.0]))
    CounterReset.objects.create(target=target, ts=now, offsets=pack([0.0]))
    ScrapeStatus.objects.create(worker=worker, up=True, last_attempt_at=now)
    ScrapeRound.objects.create(started_at=now, finished_at=now, num_targets=1)
    ServiceObjectives.current()

    template = AnalysisTemplate.default()
    rollout = Rollout.objects.create(
        routing_table=table,
        stable_pool=pool,
        canary_pool=canary,
        stable_revision=revision,
        target_revision=target_revision,
    )
    RolloutEvent.objects.create(rollout=rollout, kind="created", message="m", actor="root", phase=rollout.phase)
    run = AnalysisRun.objects.create(
        rollout=rollout,
        attempt=1,
        step_index=0,
        template_name=template.name,
        spec={},
        canary_pool_name=canary.name,
        baseline_pool_name=pool.name,
        started_at=now,
    )
    Measurement.objects.create(run=run, taken_at=now, window_seconds=60.0, phase=run.phase)

    assert AlertRule.objects.exists(), "a migration installs the shipped rules"
    alert = Alert.objects.create(
        fingerprint="f" * 16,
        labels={"alertname": "Admin", "severity": "warning"},
        state=AlertState.FIRING,
        fired_at=now,
    )
    AlertTransition.objects.create(
        alert=alert, fingerprint=alert.fingerprint, from_state=AlertState.PENDING, to_state=AlertState.FIRING, at=now
    )
    receiver = Receiver.objects.create(
        name="admin-hook", kind=Receiver.KIND_WEBHOOK, url="http://example.com/h", bearer_token="sekrit-token"
    )
    Route.objects.create(receiver=receiver, matchers=['severity="critical"'])
    group = NotificationGroup.objects.create(
        receiver=receiver, group_key="{}", group_labels={}, created_at=now, next_flush_at=now
    )
    Delivery.objects.create(receiver=receiver, group=group, payload={}, next_attempt_at=now, created_at=now)
    Silence.objects.create(
        matchers=[{"name": "alertname", "value": "Admin", "isRegex": False, "isEqual": True}],
        starts_at=now,
        ends_at=now + timedelta(hours=1),
        created_by="root",
        comment="c",
    )
    InboundAlert.objects.create(
        fingerprint="in", starts_at=now, status="firing", labels={"alertname": "X"}, received_at=now
    )
    AdvisorReport.refresh(pool, window_seconds=300.0, now=now)

    from controlplane.experiments.models import Experiment, Workload

    workload = Workload.from_scenario(name="admin-w", scenario="burst", rate=1.0, duration_seconds=10)
    lab, _ = enroll_worker("admin-lab", pool=make_pool("admin-lab", revision))
    Experiment.create(name="admin", workload=workload, workers=[lab])


@pytest.fixture
def superuser_client(client: Client) -> Client:
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", None))
    return client


def test_the_project_has_models_in_every_domain_app() -> None:
    # Guards the registry walk itself: an empty list would pass everything.
    labels = {m._meta.app_label for m in PROJECT_MODELS}
    assert {"audit", "fleet", "profiles", "gateway", "metrics", "rollouts", "alerts"} <= labels


@pytest.mark.parametrize("model", PROJECT_MODELS, ids=_label)
def test_every_project_model_is_registered_in_the_admin(model: type[Model]) -> None:
    assert model in admin.site._registry, f"{_label(model)} has no admin: add one to its app's admin.py"


@pytest.mark.parametrize("model", PROJECT_MODELS, ids=_label)
def test_every_project_model_has_admin_pages_that_render(
    one_of_everything: None, superuser_client: Client, model: type[Model]
) -> None:
    model_admin = admin.site._registry[model]
    changelist = superuser_client.get(_url(model))
    assert changelist.status_code == 200
    assert changelist.context["cl"].result_count >= 1
    if model_admin.search_fields:
        assert superuser_client.get(_url(model), {"q": "x"}).status_code == 200

    request = RequestFactory().get("/")
    request.user = changelist.wsgi_request.user
    add = superuser_client.get(_url(model, "add/"))
    assert add.status_code == (200 if model_admin.has_add_permission(request) else 403)

    obj = model._default_manager.first()
    assert obj is not None, f"add a {_label(model)} row to one_of_everything"
    assert superuser_client.get(_url(model, f"{obj.pk}/change/")).status_code == 200


@pytest.mark.parametrize("label", BIG_TABLES)
def test_big_tables_are_read_only_and_never_counted_whole(superuser_client: Client, label: str) -> None:
    model_admin = admin.site._registry[apps.get_model(label)]
    request = RequestFactory().get("/")
    request.user = get_user_model().objects.get(username="root")
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert model_admin.show_full_result_count is False
    assert model_admin.list_select_related


def test_a_receivers_bearer_token_is_not_shown_and_survives_a_save(
    one_of_everything: None, superuser_client: Client
) -> None:
    from controlplane.alerts.models import Receiver

    receiver = Receiver.objects.get(name="admin-hook")
    page = superuser_client.get(_url(Receiver, f"{receiver.pk}/change/"))
    assert b"sekrit-token" not in page.content
    form = {
        "name": "admin-hook",
        "kind": "webhook",
        "url": "http://example.com/h2",
        "bearer_token": "",
        "emails": "[]",
        "send_resolved": "on",
        "max_alerts": "0",
        "enabled": "on",
    }
    assert superuser_client.post(_url(Receiver, f"{receiver.pk}/change/"), form).status_code == 302
    receiver.refresh_from_db()
    assert (receiver.url, receiver.bearer_token) == ("http://example.com/h2", "sekrit-token")


def test_the_receiver_form_refuses_a_webhook_without_a_url(one_of_everything: None, superuser_client: Client) -> None:
    from controlplane.alerts.models import Receiver

    form = {"name": "no-url", "kind": "webhook", "url": "", "emails": "[]", "max_alerts": "0", "enabled": "on"}
    response = superuser_client.post(_url(Receiver, "add/"), form)
    assert response.status_code == 200
    assert "needs a URL" in str(response.context["adminform"].form.errors)
    assert not Receiver.objects.filter(name="no-url").exists()


def test_changing_the_objectives_in_the_admin_is_audited(one_of_everything: None, superuser_client: Client) -> None:
    from controlplane.audit.models import AuditEvent
    from controlplane.metrics.models import ServiceObjectives

    row = ServiceObjectives.current()
    form = {"ttft_seconds": "1.5", "tpot_seconds": "0.05"}
    assert superuser_client.post(_url(ServiceObjectives, f"{row.pk}/change/"), form).status_code == 302
    row.refresh_from_db()
    assert (row.ttft_seconds, row.tpot_seconds) == (1.5, 0.05)
    event = AuditEvent.objects.filter(action="metrics.objectives").get()
    assert event.actor_repr == "root"


def test_audit_rows_cannot_be_deleted_in_the_admin(one_of_everything: None, superuser_client: Client) -> None:
    from controlplane.audit.models import AuditEvent

    event = AuditEvent.objects.first()
    assert superuser_client.post(f"/admin/audit/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEvent.objects.filter(pk=event.pk).exists()
