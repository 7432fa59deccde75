"""Notifications against a real HTTP receiver: the v4 payload, grouping,
group wait / interval, repeat timing, resolved notices, retries with
backoff recorded on the alert, email, and forwarding to an Alertmanager.

The dispatcher and delivery take ``now``; the tests step it by hand."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils.dateparse import parse_datetime

from controlplane.alerts import evaluation, notify
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import (
    Alert,
    AlertRule,
    Delivery,
    NotificationGroup,
    Receiver,
    Route,
)
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from tests.controlplane.alerts.support import HTTPReceiver, firing_alert, http_receiver, resolve
from tests.controlplane.factories import enroll_worker, make_pool

T0 = datetime(2025, 5, 1, 10, 0, tzinfo=UTC)


@pytest.fixture
def hook() -> Iterator[HTTPReceiver]:
    with http_receiver() as receiver:
        yield receiver


def webhook(url: str, **fields: Any) -> Receiver:
    return Receiver.objects.create(name=fields.pop("name", "ops"), kind="webhook", url=url, **fields)


def route(receiver: Receiver, **fields: Any) -> Route:
    fields.setdefault("group_wait_seconds", 30)
    fields.setdefault("group_interval_seconds", 300)
    fields.setdefault("repeat_interval_seconds", 3600)
    return Route.objects.create(receiver=receiver, **fields)


def tick(at: datetime) -> list[int]:
    """One dispatcher pass, then every delivery it made, sent at once."""
    sent = []
    for delivery_id in notify.dispatch(at).deliveries:
        attempt = notify.deliver(delivery_id, at)
        if attempt is not None:
            sent.append(delivery_id)
    return sent


def test_a_worker_missing_alert_reaches_the_webhook_as_alertmanager_v4(
    shipped_rules: None, hook: HTTPReceiver, settings: Any
) -> None:
    settings.EXTERNAL_URL = "https://chunkpilot.example"
    AlertRule.objects.filter(key="worker-missing").update(enabled=True, for_seconds=0)
    pool = make_pool("gpu-a")
    worker, _ = enroll_worker("gpu-3", pool=pool)
    Worker.objects.filter(pk=worker.pk).update(state=WorkerState.OFFLINE)
    webhook(hook.url, is_default=True)

    evaluation.evaluate(T0)
    assert tick(T0) == []  # group_wait: 30 s
    assert len(tick(T0 + timedelta(seconds=30))) == 1

    (body,) = hook.bodies()
    assert set(body) == {
        "version",
        "groupKey",
        "truncatedAlerts",
        "status",
        "receiver",
        "groupLabels",
        "commonLabels",
        "commonAnnotations",
        "externalURL",
        "alerts",
    }
    assert body["version"] == "4"
    assert body["status"] == "firing"
    assert body["receiver"] == "ops"
    assert body["groupKey"] == '{}:{alertname="WorkerMissing"}'
    assert body["groupLabels"] == {"alertname": "WorkerMissing"}
    assert body["commonLabels"] == {"alertname": "WorkerMissing", "severity": "warning", "worker": "gpu-3"}
    assert body["externalURL"] == "https://chunkpilot.example"
    (alert,) = body["alerts"]
    assert set(alert) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
    stored = Alert.objects.get()
    assert alert["fingerprint"] == stored.fingerprint
    assert alert["annotations"]["summary"] == "Worker gpu-3 stopped answering heartbeats"
    assert alert["annotations"]["value"] == "1"
    assert parse_datetime(alert["startsAt"]) == T0
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["generatorURL"] == f"https://chunkpilot.example/alerts/{stored.pk}/"
    assert alert["annotations"]["dashboard_url"] == "https://chunkpilot.example/"  # the rule says "/"
    assert Alert.objects.get().last_notified_at == T0 + timedelta(seconds=30)


def test_alerts_are_grouped_by_the_routes_group_by_labels(db: Any, hook: HTTPReceiver) -> None:
    by_name = route(webhook(hook.url), group_by=["alertname"], group_wait_seconds=0)
    firing_alert({"alertname": "KVFragmentationHigh", "worker": "w1"}, T0)
    firing_alert({"alertname": "KVFragmentationHigh", "worker": "w2"}, T0)
    firing_alert({"alertname": "WorkerMissing", "worker": "w3"}, T0)
    tick(T0)
    messages = {b["groupLabels"]["alertname"]: b for b in hook.bodies()}
    assert sorted(messages) == ["KVFragmentationHigh", "WorkerMissing"]
    assert [a["labels"]["worker"] for a in messages["KVFragmentationHigh"]["alerts"]] == ["w1", "w2"]

    hook.requests.clear()
    NotificationGroup.objects.all().delete()
    by_name.group_by = ["alertname", "worker"]
    by_name.save()
    tick(T0 + timedelta(minutes=1))
    assert sorted(b["groupLabels"]["worker"] for b in hook.bodies()) == ["w1", "w2", "w3"]


def test_group_wait_batches_alerts_that_start_together(db: Any, hook: HTTPReceiver) -> None:
    route(webhook(hook.url), group_by=["alertname"], group_wait_seconds=30)
    firing_alert({"alertname": "X", "worker": "w1"}, T0)
    assert tick(T0) == []
    firing_alert({"alertname": "X", "worker": "w2"}, T0 + timedelta(seconds=10))
    assert tick(T0 + timedelta(seconds=20)) == []
    assert len(tick(T0 + timedelta(seconds=30))) == 1
    assert len(hook.bodies()[0]["alerts"]) == 2


def test_new_alerts_wait_for_the_group_interval_and_repeats_wait_for_the_repeat_interval(
    db: Any, hook: HTTPReceiver
) -> None:
    route(
        webhook(hook.url),
        group_by=["alertname"],
        group_wait_seconds=0,
        group_interval_seconds=300,
        repeat_interval_seconds=1800,
    )
    firing_alert({"alertname": "X", "worker": "w1"}, T0)
    assert len(tick(T0)) == 1

    firing_alert({"alertname": "X", "worker": "w2"}, T0 + timedelta(seconds=60))
    assert tick(T0 + timedelta(seconds=60)) == []  # inside the group interval
    assert len(tick(T0 + timedelta(seconds=300))) == 1  # news: a new alert
    assert hook.bodies()[-1]["alerts"][1]["labels"]["worker"] == "w2"
    assert Delivery.objects.order_by("-id").first().reason == "new alerts added"

    # Nothing new: silent at each group interval until 30 minutes after the last notice.
    for minutes in (10, 15, 20, 25, 30):
        assert tick(T0 + timedelta(minutes=minutes)) == [], minutes
    assert len(tick(T0 + timedelta(minutes=35))) == 1
    assert Delivery.objects.order_by("-id").first().reason == "repeat interval elapsed"
    assert len(hook.bodies()) == 3


def test_a_resolved_alert_is_sent_as_resolved_with_its_end(db: Any, hook: HTTPReceiver) -> None:
    route(webhook(hook.url), group_wait_seconds=0, group_interval_seconds=60)
    a = firing_alert({"alertname": "X", "worker": "w1"}, T0)
    tick(T0)
    resolve(a, T0 + timedelta(seconds=90))
    assert len(tick(T0 + timedelta(seconds=120))) == 1
    body = hook.bodies()[-1]
    assert body["status"] == "resolved"
    (alert,) = body["alerts"]
    assert alert["status"] == "resolved"
    assert parse_datetime(alert["endsAt"]) == T0 + timedelta(seconds=90)
    # Told once; the group has nothing left to say.
    assert tick(T0 + timedelta(seconds=180)) == []


def test_without_send_resolved_the_receiver_hears_no_resolved_notice(db: Any, hook: HTTPReceiver) -> None:
    route(webhook(hook.url, send_resolved=False), group_wait_seconds=0, group_interval_seconds=60)
    a = firing_alert({"alertname": "X"}, T0)
    tick(T0)
    resolve(a, T0 + timedelta(seconds=30))
    tick(T0 + timedelta(seconds=60))
    assert len(hook.bodies()) == 1
    assert NotificationGroup.objects.get().notified_firing == []


def test_failed_deliveries_retry_with_backoff_and_are_recorded_on_the_alert(
    db: Any, hook: HTTPReceiver, settings: Any
) -> None:
    settings.ALERT_DELIVERY_BACKOFF_SECONDS = 2.0
    route(webhook(hook.url), group_wait_seconds=0)
    alert = firing_alert({"alertname": "X"}, T0)
    hook.statuses = [500, 503]
    (delivery_id,) = notify.dispatch(T0).deliveries

    first = notify.deliver(delivery_id, T0)
    assert first is not None and not first.sent and first.retry_in_seconds == 2.0
    assert notify.deliver(delivery_id, T0 + timedelta(seconds=1)) is None  # not due yet
    second = notify.deliver(delivery_id, T0 + timedelta(seconds=2))
    assert second is not None and second.retry_in_seconds == 4.0
    alert.refresh_from_db()
    assert alert.num_delivery_failures == 2
    assert alert.last_delivery_error.startswith("ops: HTTP 503")
    # While it retries, the group sends nothing new.
    assert notify.dispatch(T0 + timedelta(seconds=3)).deliveries == []

    third = notify.deliver(delivery_id, T0 + timedelta(seconds=6))
    assert third is not None and third.sent
    delivery = Delivery.objects.get(pk=delivery_id)
    assert delivery.status == Delivery.SENT and delivery.num_attempts == 3
    assert [a["error"][:8] for a in delivery.attempts] == ["HTTP 500", "HTTP 503", ""]
    assert len(hook.requests) == 3
    assert NotificationGroup.objects.get().notified_firing == [alert.fingerprint]


def test_a_delivery_that_keeps_failing_gives_up_and_the_group_tries_again_later(
    db: Any, hook: HTTPReceiver, settings: Any
) -> None:
    settings.ALERT_DELIVERY_MAX_ATTEMPTS = 2
    route(webhook(hook.url), group_wait_seconds=0, group_interval_seconds=60)
    firing_alert({"alertname": "X"}, T0)
    hook.statuses = [500, 500]
    (delivery_id,) = notify.dispatch(T0).deliveries
    notify.deliver(delivery_id, T0)
    notify.deliver(delivery_id, T0 + timedelta(seconds=10))
    assert Delivery.objects.get(pk=delivery_id).status == Delivery.FAILED
    # The notification log did not move, so the next look notifies afresh.
    assert len(tick(T0 + timedelta(seconds=60))) == 1
    assert hook.bodies()[-1]["status"] == "firing"


def test_email_goes_through_djangos_mail_backend(db: Any, mailoutbox: list[Any]) -> None:
    receiver = Receiver.objects.create(name="oncall", kind="email", emails=["oncall@example.com"])
    route(receiver, group_wait_seconds=0)
    firing_alert(
        {"alertname": "ErrorRateHigh", "pool": "gpu-a", "severity": "critical"},
        T0,
        annotations={"summary": "Pool gpu-a: 0.12 of requests failed"},
    )
    tick(T0)
    (mail,) = mailoutbox
    assert mail.to == ["oncall@example.com"]
    assert mail.subject == "[FIRING:1] ErrorRateHigh"
    assert "Pool gpu-a: 0.12 of requests failed" in mail.body


def test_alerts_are_forwarded_to_an_external_alertmanager(db: Any, hook: HTTPReceiver, settings: Any) -> None:
    settings.ALERT_FORWARD_RESEND_SECONDS = 60
    Receiver.objects.create(name="upstream-am", kind="alertmanager", url=hook.url)
    a = firing_alert({"alertname": "X", "worker": "w1"}, T0)
    tick(T0)
    (body,) = hook.bodies("/api/v2/alerts")
    (posted,) = body
    assert posted["labels"] == a.labels
    assert parse_datetime(posted["startsAt"]) == T0
    assert parse_datetime(posted["endsAt"]) == T0 + timedelta(seconds=240)  # 4 × resend
    assert set(posted) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}

    assert tick(T0 + timedelta(seconds=30)) == []  # nothing changed, resend not due
    resolve(a, T0 + timedelta(seconds=40))
    tick(T0 + timedelta(seconds=45))
    assert parse_datetime(hook.bodies()[-1][0]["endsAt"]) == T0 + timedelta(seconds=40)


def test_nodata_alerts_are_notified_and_say_so(db: Any, hook: HTTPReceiver) -> None:
    route(webhook(hook.url), group_wait_seconds=0)
    firing_alert({"alertname": "KVFragmentationHigh", "worker": "w1"}, T0, state=AlertState.NODATA, value=None)
    tick(T0)
    (alert,) = hook.bodies()[0]["alerts"]
    assert alert["status"] == "firing"
    assert "no data" in alert["annotations"]["nodata"]
