"""The kill switch: a firing abort_rollout alert on a canary stops the
rollout that owns it, by itself, on a real Celery worker and beat; and an
Alertmanager webhook asking the same acts once per fingerprint and start."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.alerts import defaults, killswitch
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, AlertRule, InboundAlert, Receiver, Route
from controlplane.gateway.models import RequestLog
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout
from tests.controlplane.alerts.support import firing_alert, http_receiver
from tests.controlplane.rollouts.factories import Agents, Fleet, kinds, make_fleet
from tests.support import wait_until


def start(fleet: Fleet) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        baseline_pool=fleet.baseline,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 2500}, {"pause": {}}],
        gate={"enabled": False},
        actor="tester",
        progress_deadline_seconds=120,
    )


def phase_of(rollout: Rollout) -> Phase:
    return Phase(Rollout.objects.values_list("phase", flat=True).get(pk=rollout.pk))


def log_traffic(fleet: Fleet, ttft_by_role: dict[str, float], count: int = 60) -> None:
    """What the gateway would have logged over the last minute."""
    now = timezone.now()
    pools = {"canary": fleet.canary, "baseline": fleet.baseline, "stable": fleet.stable}
    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=f"{role}-{i}",
                created_at=now - timedelta(seconds=i),
                model=fleet.table.model,
                cohort=role,
                pool=pools[role],
                worker=fleet.workers[role][0],
                ttft_seconds=ttft,
                status=200,
                stream=True,
            )
            for role, ttft in ttft_by_role.items()
            for i in range(count)
        ]
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_firing_abort_rule_on_the_canary_aborts_the_running_rollout_by_itself(celery_with_beat: Any) -> None:
    defaults.install(AlertRule)
    AlertRule.objects.update(enabled=False)
    AlertRule.objects.filter(key="canary-ttft-regression").update(enabled=True, for_seconds=0)
    fleet = make_fleet(num_stable=2, num_canary=1, num_baseline=1)
    with Agents(fleet), http_receiver() as hook:
        receiver = Receiver.objects.create(name="oncall", kind="webhook", url=hook.url)
        Route.objects.create(
            receiver=receiver,
            group_by=["alertname"],
            group_wait_seconds=0,
            group_interval_seconds=1,
            repeat_interval_seconds=3600,
        )
        rollout = start(fleet)
        wait_until(lambda: phase_of(rollout) == Phase.PAUSED, timeout=60, what="the canary at 25%, paused")
        # Healthy so far: no canary traffic, which the rule counts as ok. The
        # pause itself was notified through notify_event.
        wait_until(
            lambda: Alert.objects.filter(source=Alert.SOURCE_EVENT, labels__alertname="RolloutPaused").exists(),
            what="the pause notified",
        )
        assert not Alert.objects.filter(source=Alert.SOURCE_RULE).exists()

        # The canary turns slow: three times its baseline's TTFT P99.
        log_traffic(fleet, {"canary": 0.9, "baseline": 0.3, "stable": 0.3})
        wait_until(lambda: phase_of(rollout) == Phase.ABORTED, timeout=60, what="the rollout aborted by the alert")
        # The on-call hears of both, through the Celery dispatcher and delivery.
        wait_until(
            lambda: (
                {"CanaryTTFTRegression", "RolloutAborted"} <= {b["groupLabels"].get("alertname") for b in hook.bodies()}
            ),
            timeout=30,
            what="both notified",
        )

    alert = Alert.objects.get(labels__alertname="CanaryTTFTRegression")
    assert alert.state == AlertState.FIRING
    assert alert.labels["pool"] == fleet.canary.name and alert.labels["cohort"] == "canary"
    assert alert.abort_rollout_id == rollout.pk
    rollout.refresh_from_db()
    assert rollout.canary_weight_bp() == 0
    requested = rollout.events.get(kind="abort_requested")
    assert requested.actor == "alert:CanaryTTFTRegression"
    assert "CanaryTTFTRegression" in requested.message and alert.fingerprint in requested.message
    events = kinds(rollout)
    assert events.index("abort_requested") < events.index("aborted")
    # an abort the system decided pages: critical (a person's own abort is info)
    notice = Alert.objects.get(source=Alert.SOURCE_EVENT, labels__alertname="RolloutAborted")
    assert notice.labels["severity"] == "critical"


def test_an_abort_rule_leaves_rollouts_of_other_canaries_alone(shipped_rules: None) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    other = make_fleet("other-model", num_stable=1, num_canary=1)
    mine, theirs = start(fleet), start(other)
    rule = AlertRule.objects.get(key="canary-ttft-regression")
    firing_alert(
        {"alertname": rule.name, "pool": fleet.canary.name, "cohort": "canary", "chunkpilot_action": "abort_rollout"},
        timezone.now(),
        rule=rule,
    )
    assert killswitch.pull_all() == [(Alert.objects.get().pk, mine.pk)]
    assert Rollout.objects.get(pk=mine.pk).abort_requested
    assert not Rollout.objects.get(pk=theirs.pk).abort_requested
    assert killswitch.pull_all() == []  # asked once; the flag is set


def test_a_notify_rule_never_aborts(shipped_rules: None) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)
    rule = AlertRule.objects.get(key="error-rate-high")
    firing_alert({"alertname": rule.name, "pool": fleet.canary.name}, timezone.now(), rule=rule)
    assert killswitch.pull_all() == []
    assert not Rollout.objects.get(pk=rollout.pk).abort_requested


def webhook_message(rollout_id: int, starts_at: str, fingerprint: str = "a1b2c3d4e5f60718") -> dict[str, Any]:
    return {
        "version": "4",
        "groupKey": '{}:{alertname="CanaryBurnRate"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "chunkpilot",
        "groupLabels": {"alertname": "CanaryBurnRate"},
        "commonLabels": {"alertname": "CanaryBurnRate"},
        "commonAnnotations": {},
        "externalURL": "http://am:9093",
        "alerts": [
            {
                "status": "firing",
                "labels": {
                    "alertname": "CanaryBurnRate",
                    "chunkpilot_action": "abort_rollout",
                    "rollout": str(rollout_id),
                    "severity": "critical",
                },
                "annotations": {"summary": "canary burns its error budget 14x"},
                "startsAt": starts_at,
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://prom:9090/graph",
                "fingerprint": fingerprint,
            },
            {
                "status": "firing",
                "labels": {"alertname": "SomethingElse"},
                "annotations": {},
                "startsAt": starts_at,
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "fingerprint": "ffff",
            },
        ],
    }


def test_an_alertmanager_webhook_aborts_a_rollout_once_per_fingerprint_and_start(
    operator_api: APIClient, operator: Any
) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)
    message = webhook_message(rollout.pk, "2025-07-01T10:00:00.000Z")

    first = operator_api.post("/api/v1/alerts/webhook/", message, format="json")
    assert first.status_code == 200, first.json()
    assert first.json() | {"outcomes": None} == {
        "num_alerts": 2,
        "num_acted": 1,
        "num_duplicates": 0,
        "num_ignored": 1,
        "num_resolved": 0,
        "outcomes": None,
    }
    rollout.refresh_from_db()
    assert rollout.abort_requested
    requested = rollout.events.get(kind="abort_requested")
    assert requested.actor == operator.username
    assert "CanaryBurnRate" in requested.message and "alertmanager webhook chunkpilot" in requested.message

    # Alertmanager repeats the notification (repeat_interval) and redelivers it: no second abort.
    again = operator_api.post("/api/v1/alerts/webhook/", message, format="json")
    assert again.json()["num_duplicates"] == 1 and again.json()["num_acted"] == 0
    assert rollout.events.filter(kind="abort_requested").count() == 1
    assert InboundAlert.objects.count() == 1


def test_a_new_start_of_the_same_alert_is_a_new_occurrence(operator_api: APIClient) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)
    operator_api.post("/api/v1/alerts/webhook/", webhook_message(rollout.pk, "2025-07-01T10:00:00Z"), format="json")
    later = operator_api.post(
        "/api/v1/alerts/webhook/", webhook_message(rollout.pk, "2025-07-01T11:00:00Z"), format="json"
    )
    assert later.json()["num_duplicates"] == 0
    assert InboundAlert.objects.count() == 2  # acted on (the rollout had its flag set already)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"alerts": "nope"}, "alerts"),
        ({"alerts": [{"status": "firing", "labels": {}, "startsAt": "yesterday"}]}, "alerts"),
        ([], "non_field_errors"),
    ],
)
def test_a_malformed_webhook_is_refused_by_field(operator_api: APIClient, body: Any, field: str) -> None:
    r = operator_api.post("/api/v1/alerts/webhook/", body, format="json")
    assert r.status_code == 400 and field in r.json()


def test_the_webhook_needs_an_operator(viewer_api: APIClient, anon_api: APIClient) -> None:
    assert viewer_api.post("/api/v1/alerts/webhook/", {"alerts": []}, format="json").status_code == 403
    assert anon_api.post("/api/v1/alerts/webhook/", {"alerts": []}, format="json").status_code == 401
