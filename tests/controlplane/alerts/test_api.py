"""The alerts, receivers and routes API: filters, one alert with its
history and notifications, field errors, audit rows."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import AlertTransition, Delivery, Receiver
from controlplane.audit.models import AuditEvent
from tests.controlplane.alerts.support import firing_alert


def test_alerts_list_active_first_and_filters_by_state_and_severity(viewer_api: APIClient) -> None:
    now = timezone.now()
    firing_alert({"alertname": "A", "pool": "p"}, now, state=AlertState.RESOLVED)
    firing_alert({"alertname": "B", "pool": "p", "severity": "critical"}, now)
    firing_alert({"alertname": "C", "pool": "p"}, now, state=AlertState.PENDING)
    names = [a["name"] for a in viewer_api.get("/api/v1/alerts/").json()["results"]]
    assert names == ["B", "C", "A"]
    assert [a["name"] for a in viewer_api.get("/api/v1/alerts/?state=active").json()["results"]] == ["B", "C"]
    assert [a["name"] for a in viewer_api.get("/api/v1/alerts/?severity=critical").json()["results"]] == ["B"]
    bad = viewer_api.get("/api/v1/alerts/?state=burning")
    assert bad.status_code == 400 and "state" in bad.json()


def test_one_alert_carries_its_transitions_and_deliveries(viewer_api: APIClient) -> None:
    now = timezone.now()
    alert = firing_alert({"alertname": "B", "pool": "p"}, now)
    AlertTransition.objects.create(
        alert=alert,
        fingerprint=alert.fingerprint,
        from_state=AlertState.PENDING,
        to_state=AlertState.FIRING,
        value=2.5,
        reason="held for 1m",
        at=now,
    )
    receiver = Receiver.objects.create(name="ops", kind="webhook", url="http://127.0.0.1:9/hook")
    Delivery.objects.create(
        receiver=receiver,
        reason="first notification",
        payload={},
        fingerprints=[alert.fingerprint],
        status=Delivery.FAILED,
        num_attempts=6,
        last_error="HTTP 500",
        next_attempt_at=now,
        created_at=now,
    )
    body = viewer_api.get(f"/api/v1/alerts/{alert.pk}/").json()
    assert body["state"] == "firing" and body["fingerprint"] == alert.fingerprint
    assert body["transitions"] == [
        {
            "at": body["transitions"][0]["at"],
            "from_state": "pending",
            "to_state": "firing",
            "value": 2.5,
            "reason": "held for 1m",
        }
    ]
    (delivery,) = body["deliveries"]
    assert delivery["receiver"] == "ops" and delivery["status"] == "failed" and delivery["last_error"] == "HTTP 500"


def test_receivers_are_validated_by_field_audited_and_keep_their_token_secret(operator_api: APIClient) -> None:
    missing_url = operator_api.post("/api/v1/alert-receivers/", {"name": "ops", "kind": "webhook"}, format="json")
    assert missing_url.status_code == 400 and "url" in missing_url.json()
    no_emails = operator_api.post("/api/v1/alert-receivers/", {"name": "mail", "kind": "email"}, format="json")
    assert no_emails.status_code == 400 and "emails" in no_emails.json()
    r = operator_api.post(
        "/api/v1/alert-receivers/",
        {
            "name": "ops",
            "kind": "webhook",
            "url": "https://hooks.example/x",
            "bearer_token": "s3cret",
            "is_default": True,
        },
        format="json",
    )
    assert r.status_code == 201, r.json()
    assert "bearer_token" not in r.json()
    event = AuditEvent.objects.get(action="alert_receiver.create")
    assert "s3cret" not in str(event.after)
    assert Receiver.objects.get().bearer_token == "s3cret"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"matchers": ['severity=~"("']}, "matchers"),
        ({"group_by": ["bad-label"]}, "group_by"),
        ({"group_interval_seconds": 0}, "group_interval_seconds"),
        ({"repeat_interval_seconds": 10, "group_interval_seconds": 60}, "repeat_interval_seconds"),
    ],
)
def test_bad_routes_are_refused_by_field(operator_api: APIClient, body: dict[str, Any], field: str) -> None:
    receiver = Receiver.objects.create(name="ops", kind="webhook", url="http://127.0.0.1:9/hook")
    r = operator_api.post("/api/v1/alert-routes/", {"receiver": receiver.pk, **body}, format="json")
    assert r.status_code == 400 and field in r.json(), r.json()


def test_a_route_to_an_external_alertmanager_is_refused(operator_api: APIClient) -> None:
    am = Receiver.objects.create(name="am", kind="alertmanager", url="http://127.0.0.1:9093")
    r = operator_api.post("/api/v1/alert-routes/", {"receiver": am.pk}, format="json")
    assert r.status_code == 400 and "receiver" in r.json()


def test_a_route_normalises_its_matchers_and_is_audited(operator_api: APIClient, operator: Any) -> None:
    receiver = Receiver.objects.create(name="ops", kind="webhook", url="http://127.0.0.1:9/hook")
    r = operator_api.post(
        "/api/v1/alert-routes/",
        {
            "receiver": receiver.pk,
            "matchers": ["severity=critical", {"name": "pool", "value": "gpu-.*", "isRegex": True, "isEqual": True}],
            "group_by": ["alertname", "pool"],
            "group_wait_seconds": 10,
        },
        format="json",
    )
    assert r.status_code == 201, r.json()
    assert r.json()["matchers"] == ['severity="critical"', 'pool=~"gpu-.*"']
    assert AuditEvent.objects.get(action="alert_route.create").actor_repr == operator.username


def test_the_openapi_document_describes_the_alerting_api(viewer_api: APIClient) -> None:
    paths = viewer_api.get("/api/schema/?format=json").json()["paths"]
    for path in (
        "/api/v1/alerts/",
        "/api/v1/alerts/webhook/",
        "/api/v1/alert-rules/",
        "/api/v1/alert-rules/{id}/test/",
        "/api/v1/silences/",
        "/api/v1/alert-receivers/",
        "/api/v1/alert-routes/",
    ):
        assert path in paths, path


@pytest.mark.django_db
def test_an_alerts_deliveries_are_those_that_carried_its_exact_fingerprint() -> None:
    """``Delivery.objects.carrying``: JSON containment here (PostgreSQL); the
    embedded default's SQLite path is walked in tests/dashboards/test_sqlite_walk.py."""
    now = timezone.now()
    receiver = Receiver.objects.create(name="ops", kind="webhook", url="http://127.0.0.1:9/hook")

    def delivery(*fingerprints: str) -> Delivery:
        return Delivery.objects.create(
            receiver=receiver, payload={}, fingerprints=list(fingerprints), next_attempt_at=now, created_at=now
        )

    both, longer, other = delivery("0a1b", "ffff"), delivery("0a1b2c"), delivery("ffff")
    assert set(Delivery.objects.carrying("0a1b")) == {both}
    assert set(Delivery.objects.carrying("ffff")) == {both, other}
    assert set(Delivery.objects.carrying("0a1b2c")) == {longer}
