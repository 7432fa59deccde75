"""Silences suppress notifications, never state: a silenced alert still
fires, changes state and shows (marked), and its receiver hears nothing
until the silence ends."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.alerts import evaluation, notify
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, AlertRule, AlertTransition, Receiver, Route, Silence
from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from tests.controlplane.alerts.support import HTTPReceiver, http_receiver
from tests.controlplane.factories import enroll_worker, make_pool

T0 = datetime(2025, 6, 1, 8, 0, tzinfo=UTC)


@pytest.fixture
def hook() -> Iterator[HTTPReceiver]:
    with http_receiver() as receiver:
        yield receiver


def send_all(at: datetime) -> int:
    sent = 0
    for delivery_id in notify.dispatch(at).deliveries:
        attempt = notify.deliver(delivery_id, at)
        sent += int(bool(attempt and attempt.sent))
    return sent


def test_a_silenced_alert_keeps_its_state_and_is_not_notified_until_the_silence_ends(
    shipped_rules: None, hook: HTTPReceiver, operator: Any
) -> None:
    AlertRule.objects.filter(key="worker-missing").update(enabled=True, for_seconds=0)
    receiver = Receiver.objects.create(name="ops", kind="webhook", url=hook.url)
    Route.objects.create(receiver=receiver, group_wait_seconds=0, group_interval_seconds=60)
    pool = make_pool("gpu-a")
    gone, _ = enroll_worker("gpu-7", pool=pool)
    silence = Silence.objects.create(
        matchers=[{"name": "worker", "value": "gpu-7", "isRegex": False, "isEqual": True}],
        starts_at=T0 - timedelta(minutes=1),
        ends_at=T0 + timedelta(minutes=10),
        created_by=operator.username,
        author=operator,
        comment="gpu-7 is being re-racked",
    )

    Worker.objects.filter(pk=gone.pk).update(state=WorkerState.OFFLINE)
    evaluation.evaluate(T0)
    assert send_all(T0) == 0
    Worker.objects.filter(pk=gone.pk).update(state=WorkerState.READY)
    evaluation.evaluate(T0 + timedelta(seconds=15))
    Worker.objects.filter(pk=gone.pk).update(state=WorkerState.OFFLINE)
    evaluation.evaluate(T0 + timedelta(seconds=30))
    assert send_all(T0 + timedelta(minutes=2)) == 0
    assert hook.requests == []

    # AlertState moved on as if nothing were silenced.
    alert = Alert.objects.get()
    assert alert.state == AlertState.FIRING
    assert list(AlertTransition.objects.order_by("at").values_list("to_state", flat=True)) == [
        AlertState.FIRING,
        AlertState.RESOLVED,
        AlertState.FIRING,
    ]

    # The silence ends: the receiver hears of the firing alert.
    silence.expire(T0 + timedelta(minutes=3))
    assert send_all(T0 + timedelta(minutes=4)) == 1
    (body,) = hook.bodies()
    assert body["alerts"][0]["labels"]["worker"] == "gpu-7"


def test_silenced_alerts_still_show_marked_in_the_api(db: Any, viewer_api: APIClient) -> None:
    from tests.controlplane.alerts.support import firing_alert

    quiet = firing_alert({"alertname": "X", "pool": "gpu-a"}, T0)
    loud = firing_alert({"alertname": "X", "pool": "gpu-b"}, T0)
    silence = Silence.objects.create(
        matchers=[{"name": "pool", "value": "gpu-a", "isRegex": False, "isEqual": True}],
        starts_at=timezone.now() - timedelta(minutes=1),
        ends_at=timezone.now() + timedelta(hours=1),
        created_by="op",
        comment="maintenance",
    )
    body = viewer_api.get("/api/v1/alerts/?state=firing").json()
    marks = {a["labels"]["pool"]: a["silenced_by"] for a in body["results"]}
    assert marks == {"gpu-a": [silence.pk], "gpu-b": []}
    only_silenced = viewer_api.get("/api/v1/alerts/?silenced=true").json()
    assert [a["id"] for a in only_silenced["results"]] == [quiet.pk]
    assert loud.pk not in [a["id"] for a in only_silenced["results"]]


def test_creating_a_silence_records_its_author_and_is_audited(operator_api: APIClient, operator: Any) -> None:
    ends = (timezone.now() + timedelta(hours=2)).isoformat()
    r = operator_api.post(
        "/api/v1/silences/",
        {
            "matchers": ['alertname="StreamStallsHigh"', 'pool=~"gpu-.*"'],
            "ends_at": ends,
            "comment": "known issue, fix deploying",
        },
        format="json",
    )
    assert r.status_code == 201, r.json()
    body = r.json()
    assert body["created_by"] == operator.username and body["status"] == "active"
    assert body["matchers"] == [
        {"name": "alertname", "value": "StreamStallsHigh", "isRegex": False, "isEqual": True},
        {"name": "pool", "value": "gpu-.*", "isRegex": True, "isEqual": True},
    ]
    assert AuditEvent.objects.filter(action="silence.create", actor_repr=operator.username).exists()

    expired = operator_api.delete(f"/api/v1/silences/{body['id']}/")
    assert expired.status_code == 200 and expired.json()["status"] == "expired"
    assert Silence.objects.filter(pk=body["id"]).exists()  # kept as history
    assert AuditEvent.objects.filter(action="silence.expire").exists()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"matchers": ['pool=~"("'], "comment": "x"}, "matchers"),
        ({"matchers": [], "comment": "x"}, "matchers"),
        ({"matchers": ['pool=~".*"'], "comment": "x"}, "matchers"),  # would silence everything
        ({"matchers": ['pool="a"'], "comment": ""}, "comment"),
        (
            {
                "matchers": ['pool="a"'],
                "comment": "x",
                "starts_at": "2030-01-02T00:00:00Z",
                "ends_at": "2030-01-01T00:00:00Z",
            },
            "ends_at",
        ),
    ],
)
def test_bad_silences_are_refused_naming_the_field(
    operator_api: APIClient, payload: dict[str, Any], field: str
) -> None:
    payload.setdefault("ends_at", (timezone.now() + timedelta(hours=1)).isoformat())
    r = operator_api.post("/api/v1/silences/", payload, format="json")
    assert r.status_code == 400
    assert field in r.json()


def test_a_viewer_cannot_silence(viewer_api: APIClient) -> None:
    r = viewer_api.post(
        "/api/v1/silences/",
        {"matchers": ['pool="a"'], "comment": "x", "ends_at": (timezone.now() + timedelta(hours=1)).isoformat()},
        format="json",
    )
    assert r.status_code == 403
