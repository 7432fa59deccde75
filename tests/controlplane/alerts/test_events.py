"""notify_event: the door other apps (rollouts) use to send notices."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.alerts import notify
from controlplane.alerts.labels import fingerprint
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, AlertTransition

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)


def test_an_event_fires_once_per_label_set_and_resolves_after_its_ttl(db: Any) -> None:
    alert = notify.notify_event(
        "RolloutAborted",
        labels={"rollout": "12"},
        summary="rollout 12 aborted",
        severity="critical",
        ttl_seconds=60,
        now=T0,
    )
    assert alert.state == AlertState.FIRING and alert.fired_at == T0
    assert alert.labels == {
        "rollout": "12",
        "alertname": "RolloutAborted",
        "severity": "critical",
        "chunkpilot_event": "true",
    }
    assert alert.fingerprint == fingerprint(alert.labels)

    again = notify.notify_event(
        "RolloutAborted",
        labels={"rollout": "12"},
        summary="still aborted",
        severity="critical",
        ttl_seconds=60,
        now=T0 + timedelta(seconds=30),
    )
    assert again.pk == alert.pk and again.fired_at == T0  # refreshed, not re-fired
    assert AlertTransition.objects.filter(alert=alert).count() == 1

    notify.dispatch(T0 + timedelta(seconds=89))
    assert Alert.objects.get(pk=alert.pk).state == AlertState.FIRING
    notify.dispatch(T0 + timedelta(seconds=91))
    expired = Alert.objects.get(pk=alert.pk)
    assert expired.state == AlertState.RESOLVED and expired.resolved_at == T0 + timedelta(seconds=90)


def test_an_event_may_carry_its_name_and_severity_in_its_labels(db: Any) -> None:
    alert = notify.notify_event(
        labels={"alertname": "RolloutPaused", "severity": "warning", "rollout": "3"},
        annotations={"summary": "rollout 3 paused", "description": "inconclusive analysis"},
        now=T0,
    )
    assert alert.labels == {
        "alertname": "RolloutPaused",
        "severity": "warning",
        "rollout": "3",
        "chunkpilot_event": "true",
    }
    assert alert.annotations == {"summary": "rollout 3 paused", "description": "inconclusive analysis"}


def test_retention_forgets_old_history_but_not_what_is_still_active(db: Any) -> None:
    from controlplane.alerts import retention
    from controlplane.alerts.models import Delivery, Receiver

    old = T0 - timedelta(days=40)
    quiet = notify.notify_event("Old", labels={"x": "1"}, summary="old", now=old, ttl_seconds=1)
    notify.dispatch(old + timedelta(seconds=5))  # it resolves
    Alert.objects.filter(pk=quiet.pk).update(state_changed_at=old)
    firing = notify.notify_event("StillFiring", labels={"x": "2"}, summary="now", now=old, ttl_seconds=10**9)
    receiver = Receiver.objects.create(name="ops", kind="webhook", url="http://127.0.0.1:9/")
    Delivery.objects.create(receiver=receiver, payload={}, status=Delivery.SENT, next_attempt_at=old, created_at=old)
    counts = retention.purge(T0)
    assert counts["alerts"] == 1 and counts["deliveries"] == 1
    assert list(Alert.objects.values_list("pk", flat=True)) == [firing.pk]
    assert not AlertTransition.objects.filter(at__lt=T0 - timedelta(days=30)).exists()
