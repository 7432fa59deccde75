"""Alert rules over the API: bad rules are refused naming the field, the
shipped rules are there and can be switched off, every write is audited,
and "test now" shows the current value."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.alerts import defaults
from controlplane.alerts.models import AlertRule
from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, make_pool

GOOD = {
    "name": "StallsOnGpuA",
    "figure": "client_stall_p99",
    "selector": {"pool": "gpu-a"},
    "group_by": "pool",
    "window_seconds": 300,
    "comparator": ">",
    "threshold": 2.0,
    "for_seconds": 120,
    "keep_firing_for_seconds": 60,
    "no_data_state": "ok",
    "severity": "warning",
    "labels": {"team": "serving"},
    "summary": "stalls {{ $value }} s",
    "runbook_url": "https://runbooks.example/stalls",
}


def test_a_good_rule_is_created_and_audited(operator_api: APIClient, operator: Any) -> None:
    r = operator_api.post("/api/v1/alert-rules/", GOOD, format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert body["condition"] == "client_stall_p99[5m] > 2"
    assert body["shipped"] is False
    event = AuditEvent.objects.get(action="alert_rule.create")
    assert event.actor_repr == operator.username and event.after["figure"] == "client_stall_p99"


BAD = [
    ({"figure": "ttft_p999"}, "figure"),
    ({"name": "stalls on gpu-a"}, "name"),
    ({"selector": {"region": "eu"}}, "selector"),
    ({"selector": {"cohort": "shadow"}}, "selector"),
    ({"selector": "gpu-a"}, "selector"),
    ({"group_by": "length_bucket"}, "group_by"),
    ({"figure": "kv_fragmentation", "selector": {"labels": {"zone": "a"}}, "group_by": "pool"}, "selector"),
    ({"window_seconds": 0}, "window_seconds"),
    ({"window_seconds": 30 * 86400}, "window_seconds"),
    ({"comparator": "=>"}, "comparator"),
    ({"threshold": -1}, "threshold"),
    ({"for_seconds": -5}, "for_seconds"),
    ({"keep_firing_for_seconds": 30 * 86400}, "keep_firing_for_seconds"),
    ({"no_data_state": "ignore"}, "no_data_state"),
    ({"severity": "page"}, "severity"),
    ({"labels": {"alertname": "Other"}}, "labels"),
    ({"labels": {"bad-name": "x"}}, "labels"),
    ({"action": "abort_rollout"}, "action"),  # selector is a pool, not the canary cohort
    ({"action": "restart"}, "action"),
    ({"compare_to": "canary"}, "compare_to"),
    ({"compare_to": "baseline", "group_by": "worker", "selector": {"cohort": "canary"}}, "compare_to"),
    ({"floor": 0.5}, "floor"),  # a floor belongs to ratio rules
    ({"figure": "worker_missing", "compare_to": "stable", "selector": {"cohort": "canary"}}, "compare_to"),
]


@pytest.mark.parametrize(("change", "field"), BAD)
def test_bad_rules_are_rejected_with_the_field_named(
    operator_api: APIClient, change: dict[str, Any], field: str
) -> None:
    r = operator_api.post("/api/v1/alert-rules/", {**GOOD, **change}, format="json")
    assert r.status_code == 400, r.json()
    assert field in r.json(), r.json()
    assert not AlertRule.objects.filter(name=GOOD["name"]).exists()


def test_abort_rollout_is_accepted_on_the_canary_cohort(operator_api: APIClient) -> None:
    r = operator_api.post(
        "/api/v1/alert-rules/",
        {
            **GOOD,
            "name": "CanaryStalls",
            "selector": {"cohort": "canary"},
            "action": "abort_rollout",
            "compare_to": "stable",
            "threshold": 1.5,
            "floor": 0.5,
            "severity": "critical",
        },
        format="json",
    )
    assert r.status_code == 201, r.json()
    assert r.json()["condition"] == "client_stall_p99[5m] / stable > 1.5 and client_stall_p99 > 0.5"


def test_the_shipped_rules_are_there_and_each_can_be_switched_off(shipped_rules: None, operator_api: APIClient) -> None:
    AlertRule.objects.update(enabled=True)
    shipped = {r["name"]: r for r in operator_api.get("/api/v1/alert-rules/").json()["results"] if r["shipped"]}
    assert set(shipped) == {
        "CanaryTTFTRegression",
        "StreamStallsHigh",
        "ErrorRateHigh",
        "WorkerMissing",
        "ProfileDrift",
        "KVFragmentationHigh",
        "MemoryPeakToMeanHigh",
    }
    assert shipped["CanaryTTFTRegression"]["action"] == "abort_rollout"
    for rule in shipped.values():
        r = operator_api.patch(f"/api/v1/alert-rules/{rule['id']}/", {"enabled": False}, format="json")
        assert r.status_code == 200, r.json()
    assert not AlertRule.objects.filter(enabled=True).exists()
    assert AuditEvent.objects.filter(action="alert_rule.update").count() == 7


def test_every_shipped_rule_passes_validation(db: Any) -> None:
    for spec in defaults.DEFAULT_RULES:
        fields = {k: v for k, v in spec.items() if k != "key"}
        AlertRule(**fields).full_clean(validate_unique=False)


def test_a_viewer_reads_rules_but_cannot_write_them(viewer_api: APIClient) -> None:
    assert viewer_api.get("/api/v1/alert-rules/").status_code == 200
    assert viewer_api.post("/api/v1/alert-rules/", GOOD, format="json").status_code == 403


def test_test_now_shows_the_current_value_per_group_without_storing(
    shipped_rules: None, operator_api: APIClient
) -> None:
    pool = make_pool("gpu-a")
    for name in ("w1", "w2"):
        enroll_worker(name, pool=pool)
    Worker.objects.filter(name="w2").update(state=WorkerState.OFFLINE)
    rule = AlertRule.objects.get(key="worker-missing")
    r = operator_api.get(f"/api/v1/alert-rules/{rule.pk}/test/")
    assert r.status_code == 200
    groups = {g["labels"]["worker"]: (g["value"], g["condition"]) for g in r.json()["groups"]}
    assert groups == {"w1": (0.0, "clear"), "w2": (1.0, "holds")}

    draft = operator_api.post(
        "/api/v1/alert-rules/test/",
        {
            **GOOD,
            "name": "MissingPerPool",
            "figure": "worker_missing",
            "selector": {},
            "group_by": "pool",
            "no_data_state": "nodata",
        },
        format="json",
    )
    assert draft.status_code == 200, draft.json()
    (group,) = draft.json()["groups"]
    assert group["labels"]["pool"] == "gpu-a" and group["value"] == 1.0
    bad = operator_api.post("/api/v1/alert-rules/test/", {**GOOD, "figure": "nope"}, format="json")
    assert bad.status_code == 400 and "figure" in bad.json()
    assert not AlertRule.objects.filter(name="MissingPerPool").exists()


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"min_requests_per_second": -1}, "0 or more"),
        ({"min_requests_per_second": 0.1}, "scraped"),  # client_stall_p99 comes from the request log
        ({"figure": "worker_missing", "min_requests_per_second": 0.1, "group_by": "worker", "selector": {}}, "scraped"),
    ],
)
def test_a_load_minimum_is_refused_where_it_cannot_be_read(
    operator_api: APIClient, fields: dict[str, Any], why: str
) -> None:
    r = operator_api.post("/api/v1/alert-rules/", {**GOOD, **fields}, format="json")
    assert r.status_code == 400 and why in " ".join(r.json()["min_requests_per_second"]), r.json()


def test_a_load_minimum_on_a_scraped_figure_is_kept(operator_api: APIClient) -> None:
    rule = {**GOOD, "figure": "memory_peak_to_mean", "group_by": "worker", "selector": {}, "no_data_state": "nodata"}
    r = operator_api.post("/api/v1/alert-rules/", {**rule, "min_requests_per_second": 0.2}, format="json")
    assert r.status_code == 201, r.json()
    assert AlertRule.objects.get(pk=r.json()["id"]).min_requests_per_second == 0.2


def test_the_shipped_memory_rule_needs_load_and_worker_missing_waits_a_minute(shipped_rules: None) -> None:
    memory = AlertRule.objects.get(key="memory-peak-to-mean-high")
    assert memory.min_requests_per_second == defaults.MEMORY_RULE_MIN_REQUESTS_PER_SECOND > 0
    assert AlertRule.objects.get(key="worker-missing").for_seconds == defaults.WORKER_MISSING_FOR_SECONDS >= 60
