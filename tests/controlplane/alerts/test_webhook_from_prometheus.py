"""The inbound Alertmanager webhook with alerts as Prometheus makes them
from the shipped rules: labelled with a pool, not a rollout. A firing one
aborts the running rollout that owns that canary pool; its resolved
notification is recorded on the same row."""

from __future__ import annotations

from typing import Any

from django.utils.dateparse import parse_datetime
from rest_framework.test import APIClient

from controlplane.alerts.models import InboundAlert
from controlplane.metrics import deploy
from controlplane.rollouts.models import Rollout
from tests.controlplane.rollouts.factories import Fleet, make_fleet

STARTS_AT = "2025-07-01T10:00:00.000Z"
ENDS_AT = "2025-07-01T10:04:30.000Z"


def start(fleet: Fleet) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 2500}, {"pause": {}}],
        gate={"enabled": False},
        actor="tester",
        progress_deadline_seconds=120,
    )


def shipped_rule_alert(pool: str, status: str = "firing", fingerprint: str = "5e1c0a7f00d2b3a4") -> dict[str, Any]:
    """The shipped ChunkpilotCanaryTTFTRegression as Alertmanager delivers it."""
    rule = next(
        r
        for g in deploy.prometheus_rules()["groups"]
        for r in g["rules"]
        if r.get("alert") == "ChunkpilotCanaryTTFTRegression"
    )
    labels = {"alertname": rule["alert"], **rule["labels"], "model_name": "tiny", "pool": pool, "cohort": "canary"}
    return {
        "version": "4",
        "groupKey": '{}/{chunkpilot_action="abort_rollout"}:{alertname="ChunkpilotCanaryTTFTRegression"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": deploy.WEBHOOK_RECEIVER,
        "groupLabels": {"alertname": rule["alert"]},
        "commonLabels": labels,
        "commonAnnotations": {},
        "externalURL": "http://am:9093",
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": {"summary": "The TTFT P99 of canary gpu-c is 4.7s, over 1.2× its baseline's"},
                "startsAt": STARTS_AT,
                "endsAt": ENDS_AT if status == "resolved" else "0001-01-01T00:00:00Z",
                "generatorURL": "http://prom:9090/graph",
                "fingerprint": fingerprint,
            }
        ],
    }


def test_a_firing_shipped_rule_aborts_the_rollout_that_owns_its_canary_pool(
    operator_api: APIClient, operator: Any
) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)

    reply = operator_api.post("/api/v1/alerts/webhook/", shipped_rule_alert(fleet.canary.name), format="json")

    assert reply.status_code == 200, reply.json()
    assert (reply.json()["num_acted"], reply.json()["num_ignored"]) == (1, 0)
    assert reply.json()["outcomes"][0]["outcome"] == f"rollout {rollout.pk}: abort requested"
    rollout.refresh_from_db()
    assert rollout.abort_requested
    requested = rollout.events.get(kind="abort_requested")
    assert requested.actor == operator.username
    assert "ChunkpilotCanaryTTFTRegression" in requested.message and "5e1c0a7f00d2b3a4" in requested.message


def test_an_alert_on_a_pool_no_rollout_owns_is_recorded_and_aborts_nothing(operator_api: APIClient) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)

    # The stable pool is no rollout's canary.
    reply = operator_api.post("/api/v1/alerts/webhook/", shipped_rule_alert(fleet.stable.name), format="json")

    assert reply.json()["num_acted"] == 0
    assert InboundAlert.objects.get().outcome == f"no running rollout owns canary pool {fleet.stable.name}"
    assert not Rollout.objects.get(pk=rollout.pk).abort_requested


def test_the_resolved_notification_is_recorded_on_the_row_of_the_firing_one(operator_api: APIClient) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    start(fleet)
    operator_api.post("/api/v1/alerts/webhook/", shipped_rule_alert(fleet.canary.name), format="json")

    for _ in range(2):  # Alertmanager may send it again: still one row
        reply = operator_api.post(
            "/api/v1/alerts/webhook/", shipped_rule_alert(fleet.canary.name, "resolved"), format="json"
        )
        assert reply.json()["num_resolved"] == 1 and reply.json()["num_acted"] == 0

    record = InboundAlert.objects.get()
    assert record.status == "resolved" and record.ends_at == parse_datetime(ENDS_AT)
    assert record.outcome.endswith(": abort requested")  # what the firing one did stays


def test_a_resolved_notification_whose_firing_one_never_came_is_recorded_and_does_nothing(
    operator_api: APIClient,
) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)

    reply = operator_api.post(
        "/api/v1/alerts/webhook/", shipped_rule_alert(fleet.canary.name, "resolved"), format="json"
    )

    assert reply.json()["num_resolved"] == 1
    record = InboundAlert.objects.get()
    assert record.status == "resolved" and "never arrived" in record.outcome
    assert not Rollout.objects.get(pk=rollout.pk).abort_requested


def test_an_acting_alert_that_names_no_pool_worker_or_rollout_is_ignored(operator_api: APIClient) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = start(fleet)
    message = shipped_rule_alert(fleet.canary.name)
    for key in ("pool", "cohort", "model_name"):
        message["alerts"][0]["labels"].pop(key)

    reply = operator_api.post("/api/v1/alerts/webhook/", message, format="json")

    assert (reply.json()["num_ignored"], reply.json()["num_acted"]) == (1, 0)
    assert not Rollout.objects.get(pk=rollout.pk).abort_requested and not InboundAlert.objects.exists()
