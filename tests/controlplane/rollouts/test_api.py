"""Rollouts and analysis templates over the API: buttons set flags and write
audit rows, bad input is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.rollouts.models import AnalysisTemplate, Rollout
from tests.controlplane.rollouts.factories import Fleet, make_fleet

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(db: Any) -> Fleet:
    return make_fleet(num_stable=2, num_canary=1)


def body(fleet: Fleet, **kw: Any) -> dict[str, Any]:
    return {
        "model": fleet.table.model,
        "stable_pool": fleet.stable.name,
        "canary_pool": fleet.canary.name,
        "target_revision": fleet.target_revision.pk,
        **kw,
    }


def test_a_rollout_is_created_from_a_profile_revision_with_the_default_plan(operator_api: APIClient, fleet) -> None:
    r = operator_api.post("/api/v1/rollouts/", body(fleet), format="json")
    assert r.status_code == 201, r.json()
    data = r.json()
    assert data["steps"] == [
        {"set_weight": 1000},
        {"analysis": {"template": "default"}},
        {"set_weight": 2500},
        {"analysis": {"template": "default"}},
        {"set_weight": 5000},
        {"analysis": {"template": "default"}},
        {"set_weight": 10000},
    ]
    assert data["stable_revision"]["id"] == fleet.stable_revision.pk
    assert data["target_revision"]["label"].endswith("@2")
    assert data["phase"] == "pending" and data["gate_status"] == "pending"  # a chunked target is gated
    assert data["timeline"][0]["kind"] == "created"
    assert AnalysisTemplate.objects.filter(name="default").exists()
    audit = AuditEvent.objects.get(action="rollout.create")
    assert audit.actor_repr.startswith("operator") and audit.after["target_revision"] == fleet.target_revision.pk


def test_a_named_template_fills_the_default_plan(operator_api: APIClient, fleet) -> None:
    AnalysisTemplate.objects.create(name="strict", metrics=[{"name": "ttft", "figure": "client_ttft_p99"}])
    r = operator_api.post("/api/v1/rollouts/", body(fleet, analysis_template="strict"), format="json")
    assert r.status_code == 201
    assert {"analysis": {"template": "strict"}} in r.json()["steps"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"canary_pool": "STABLE"}, "canary_pool"),
        ({"target_revision": "STABLE_REV"}, "target_revision"),
        ({"steps": [{"set_weight": 20000}]}, "steps"),
        ({"steps": [{"jump": 1}]}, "steps"),
        ({"steps": [{"analysis": {"template": "nope"}}]}, "steps"),
        ({"gate": {"max_tokens": 0}}, "gate"),
        ({"gate": {"prompts": [""]}}, "gate"),
        ({"gate": {"prompts": [[16] * 100]}}, "gate"),  # one chunk boundary of the target's 64 tokens: too few
        ({"model": "no-such-model"}, "model"),
        ({"baseline_pool": "CANARY"}, "baseline_pool"),
        ({"progress_deadline_seconds": 0}, "progress_deadline_seconds"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(operator_api: APIClient, fleet, change, field) -> None:
    names = {"STABLE": fleet.stable.name, "CANARY": fleet.canary.name, "STABLE_REV": fleet.stable_revision.pk}
    change = {k: names.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    r = operator_api.post("/api/v1/rollouts/", body(fleet, **change), format="json")
    assert r.status_code == 400, r.json()
    assert field in r.json(), r.json()
    assert not Rollout.objects.exists()


def test_one_rollout_at_a_time_per_table(operator_api: APIClient, fleet) -> None:
    assert operator_api.post("/api/v1/rollouts/", body(fleet), format="json").status_code == 201
    r = operator_api.post("/api/v1/rollouts/", body(fleet), format="json")
    assert r.status_code == 400 and "still running" in r.json()["non_field_errors"][0]


def test_viewers_read_but_cannot_act(viewer_api: APIClient, operator_api: APIClient, fleet) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    assert viewer_api.get(f"/api/v1/rollouts/{rollout_id}/").status_code == 200
    assert viewer_api.post(f"/api/v1/rollouts/{rollout_id}/abort/").status_code == 403
    assert viewer_api.post("/api/v1/rollouts/", body(fleet), format="json").status_code == 403


def test_abort_only_sets_the_flag_and_writes_an_audit_row(operator_api: APIClient, fleet) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    r = operator_api.post(f"/api/v1/rollouts/{rollout_id}/abort/", {"reason": "p99 looks off"}, format="json")
    assert r.status_code == 200
    assert r.json()["flags"] == ["abort"] and r.json()["phase"] == "pending"  # the reconciler acts, not the view
    rollout = Rollout.objects.get(pk=rollout_id)
    assert rollout.abort_requested and "p99 looks off" in rollout.abort_reason
    audit = AuditEvent.objects.get(action="rollout.abort")
    assert audit.after == {"abort_requested": True, "reason": "p99 looks off", "source": "api"}
    assert rollout.events.filter(kind="abort_requested").exists()
    # pressing it again is harmless
    assert operator_api.post(f"/api/v1/rollouts/{rollout_id}/abort/").status_code == 200
    assert AuditEvent.objects.filter(action="rollout.abort").count() == 1


@pytest.mark.parametrize(
    ("action", "flag"),
    [("promote-full", "promote_full_requested")],
)
def test_buttons_set_their_flags(operator_api: APIClient, fleet, action, flag) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    r = operator_api.post(f"/api/v1/rollouts/{rollout_id}/{action}/")
    assert r.status_code == 200, r.json()
    assert getattr(Rollout.objects.get(pk=rollout_id), flag)
    assert AuditEvent.objects.filter(action=f"rollout.{flag.removesuffix('_requested')}").exists()


@pytest.mark.parametrize("action", ["promote", "skip-step", "retry", "rollback"])
def test_buttons_that_do_not_fit_the_phase_are_a_400(operator_api: APIClient, fleet, action) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    r = operator_api.post(f"/api/v1/rollouts/{rollout_id}/{action}/")
    assert r.status_code == 400
    assert "non_field_errors" in r.json()


@pytest.mark.parametrize(
    ("action", "phase", "flag"),
    [
        ("promote", "PAUSED", "promote_requested"),
        ("promote", "PROGRESSING", "promote_requested"),
        ("skip-step", "PROGRESSING", "skip_step_requested"),
        ("skip-step", "PAUSED", "skip_step_requested"),
        ("retry", "ABORTED", "retry_requested"),
    ],
)
def test_buttons_that_fit_the_phase_set_their_flag_and_write_an_audit_row(
    operator_api: APIClient, fleet, action, phase, flag
) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    Rollout.objects.filter(pk=rollout_id).update(phase=getattr(Rollout.Phase, phase))
    r = operator_api.post(f"/api/v1/rollouts/{rollout_id}/{action}/")
    assert r.status_code == 200, r.json()
    verb = flag.removesuffix("_requested")
    assert action in r.json()["flags"] and r.json()["phase"] == phase.lower()  # the reconciler acts, not the view
    rollout = Rollout.objects.get(pk=rollout_id)
    assert getattr(rollout, flag)
    audit = AuditEvent.objects.get(action=f"rollout.{verb}", object_id=str(rollout_id))
    assert audit.actor_repr.startswith("operator")
    assert (audit.before, audit.after) == ({flag: False}, {flag: True})
    assert rollout.events.filter(kind=f"{verb}_requested").exists()


def test_rollback_of_a_succeeded_rollout_starts_a_fast_tracked_one_and_writes_an_audit_row(
    operator_api: APIClient, fleet
) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    Rollout.objects.filter(pk=rollout_id).update(phase=Rollout.Phase.SUCCEEDED)
    r = operator_api.post(f"/api/v1/rollouts/{rollout_id}/rollback/")
    assert r.status_code == 201, r.json()
    back = r.json()
    assert back["id"] != rollout_id and back["fast_track"] and back["steps"] == []
    assert back["rollback_of"] == rollout_id
    assert back["target_revision"]["id"] == fleet.stable_revision.pk
    assert back["stable_revision"]["id"] == fleet.target_revision.pk
    assert back["gate_status"] == "skipped"
    audit = AuditEvent.objects.get(action="rollout.rollback")
    assert audit.actor_repr.startswith("operator") and audit.object_id == str(back["id"])
    assert audit.after["fast_track"] and audit.after["target_revision"] == fleet.stable_revision.pk
    # only once: the first rollback is still running
    again = operator_api.post(f"/api/v1/rollouts/{rollout_id}/rollback/")
    assert again.status_code == 400 and "still running" in again.json()["non_field_errors"][0]


def test_a_finished_rollout_cannot_be_aborted_but_can_be_deleted(operator_api: APIClient, fleet) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    assert operator_api.delete(f"/api/v1/rollouts/{rollout_id}/").status_code == 400
    Rollout.objects.filter(pk=rollout_id).update(phase=Rollout.Phase.ABORTED)
    r = operator_api.post(f"/api/v1/rollouts/{rollout_id}/abort/")
    assert r.status_code == 400 and "nothing to abort" in r.json()["non_field_errors"][0]
    assert operator_api.delete(f"/api/v1/rollouts/{rollout_id}/").status_code == 204
    assert AuditEvent.objects.filter(action="rollout.delete").exists()


def test_active_filter_lists_unfinished_rollouts(operator_api: APIClient, fleet) -> None:
    rollout_id = operator_api.post("/api/v1/rollouts/", body(fleet), format="json").json()["id"]
    assert [r["id"] for r in operator_api.get("/api/v1/rollouts/?active=true").json()["results"]] == [rollout_id]
    assert operator_api.get("/api/v1/rollouts/?active=false").json()["results"] == []


# ---- analysis templates ------------------------------------------------------------------
TEMPLATE = {
    "name": "latency",
    "metrics": [
        {"name": "ttft", "figure": "client_ttft_p99", "direction": "lower", "max_ratio": 1.3, "floor": 0.05},
        {"name": "itl", "figure": "itl_p99", "max_ratio": 1.3, "floor": 0.01},
        {"name": "stalls", "figure": "client_stall_p99"},
        {"name": "tpot", "figure": "client_tpot_p99"},
        {"name": "errors", "figure": "error_rate", "test": "error_rate", "floor": 0.01},
        {"name": "throughput", "figure": "client_requests_per_second", "direction": "higher", "max_ratio": 1.5},
    ],
    "interval_seconds": 20,
    "count": 4,
    "initial_delay_seconds": 10,
    "failure_limit": 1,
    "inconclusive_limit": 2,
    "consecutive_error_limit": 3,
}


def test_analysis_templates_are_crud_and_audited(operator_api: APIClient, db) -> None:
    r = operator_api.post("/api/v1/analysis-templates/", TEMPLATE, format="json")
    assert r.status_code == 201, r.json()
    tid = r.json()["id"]
    r = operator_api.patch(f"/api/v1/analysis-templates/{tid}/", {"count": 5}, format="json")
    assert r.status_code == 200 and r.json()["count"] == 5
    assert AnalysisTemplate.objects.get(pk=tid).spec().count == 5
    assert operator_api.delete(f"/api/v1/analysis-templates/{tid}/").status_code == 204
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"analysis_template.create", "analysis_template.update", "analysis_template.delete"} <= actions


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"metrics": [{"name": "x", "figure": "no_such_figure"}]}, "metrics", "figure must be one of"),
        ({"metrics": [{"name": "x", "figure": "ttft_p99", "direction": "sideways"}]}, "metrics", "direction"),
        ({"metrics": [{"name": "x", "figure": "ttft_p99", "max_ratio": 0.5}]}, "metrics", "max_ratio"),
        ({"metrics": [{"name": "x", "figure": "ttft_p99"}, {"name": "x", "figure": "itl_p99"}]}, "metrics", "twice"),
        ({"metrics": []}, "metrics", "non-empty"),
        ({"interval_seconds": 0}, "interval_seconds", "positive"),
        ({"count": 0}, "count", "at least one"),
    ],
)
def test_bad_templates_are_a_400_naming_the_field(operator_api: APIClient, db, change, field, text) -> None:
    r = operator_api.post("/api/v1/analysis-templates/", {**TEMPLATE, **change}, format="json")
    assert r.status_code == 400
    assert field in r.json() and text in " ".join(r.json()[field]), r.json()
