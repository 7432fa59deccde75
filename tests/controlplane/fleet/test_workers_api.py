from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db


def names(response) -> list[str]:  # type: ignore[no-untyped-def]
    assert response.status_code == 200, response.content
    return [w["name"] for w in response.json()["results"]]


def test_list_filters_by_pool_state_and_drift(viewer_api: APIClient) -> None:
    revision = make_profile()
    a, b = make_pool("a", revision), make_pool("b")
    drifting, _ = enroll_worker("drifting", pool=a)
    enroll_worker("quiet", pool=b)
    assert names(viewer_api.get("/api/v1/workers/?pool=a")) == ["drifting"]
    assert names(viewer_api.get(f"/api/v1/workers/?pool={b.pk}")) == ["quiet"]
    assert names(viewer_api.get("/api/v1/workers/?state=registering")) == ["drifting", "quiet"]
    assert names(viewer_api.get("/api/v1/workers/?drifting=true")) == [], "inside the grace period"
    with time_machine.travel(timezone.now() + timedelta(seconds=600)):
        assert names(viewer_api.get("/api/v1/workers/?drifting=true")) == ["drifting"]
        assert names(viewer_api.get("/api/v1/workers/?drifting=false")) == ["quiet"]
        body = viewer_api.get(f"/api/v1/workers/{drifting.pk}/").json()
    assert body["drifting"] is True and body["desired"]["id"] == revision.pk and body["running"] is None


def test_list_with_an_unknown_state_is_400(viewer_api: APIClient) -> None:
    response = viewer_api.get("/api/v1/workers/?state=sleepy")
    assert response.status_code == 400 and "state" in response.json()


@pytest.mark.parametrize(
    ("verb", "expected"),
    [
        ("drain", {"drain_requested": True, "cordoned": True}),
        ("cordon", {"drain_requested": False, "cordoned": True}),
        ("undrain", {"drain_requested": False, "cordoned": False}),
        ("uncordon", {"drain_requested": False, "cordoned": False}),
    ],
)
def test_flag_actions_set_the_flags_and_audit_before_and_after(
    operator_api: APIClient, verb: str, expected: dict
) -> None:
    worker, _ = enroll_worker()
    response = operator_api.post(f"/api/v1/workers/{worker.pk}/{verb}/")
    assert response.status_code == 200, response.content
    assert {k: response.json()[k] for k in expected} == expected
    worker.refresh_from_db()
    assert {"drain_requested": worker.drain_requested, "cordoned": worker.cordoned} == expected
    event = AuditEvent.objects.get(action=f"worker.{verb}")
    assert event.before["cordoned"] is False and event.after["cordoned"] == expected["cordoned"]


def test_a_per_worker_override_makes_a_canary_of_one(operator_api: APIClient) -> None:
    stable = make_profile("stable")
    canary = make_profile("canary", max_num_batched_tokens=1024)
    pool = make_pool("p", stable)
    one, _ = enroll_worker("one", pool=pool)
    other, _ = enroll_worker("other", pool=pool)
    response = operator_api.patch(f"/api/v1/workers/{one.pk}/", {"desired_revision": canary.pk}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["desired"]["label"] == "canary@1"
    one = Worker.objects.for_heartbeat().get(pk=one.pk)
    other = Worker.objects.for_heartbeat().get(pk=other.pk)
    assert one.desired_revision_for_agent()["revision_id"] == canary.pk
    assert other.desired_revision_for_agent()["revision_id"] == stable.pk
    event = AuditEvent.objects.get(action="worker.update")
    assert (event.before["desired_revision"], event.after["desired_revision"]) == (None, canary.pk)
    # and back to following the pool
    operator_api.patch(f"/api/v1/workers/{one.pk}/", {"desired_revision": None}, format="json")
    assert Worker.objects.for_heartbeat().get(pk=one.pk).desired_revision_for_agent()["revision_id"] == stable.pk


@pytest.mark.parametrize(
    ("body", "bad_field"),
    [
        ({"labels": {"zone": 3}}, "labels"),
        ({"labels": "zone=a"}, "labels"),
        ({"pool": 999999}, "pool"),
        ({"desired_revision": 999999}, "desired_revision"),
    ],
)
def test_patch_with_bad_input_is_400_by_field(operator_api: APIClient, body: dict, bad_field: str) -> None:
    worker, _ = enroll_worker()
    response = operator_api.patch(f"/api/v1/workers/{worker.pk}/", body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()
    assert not AuditEvent.objects.filter(action="worker.update").exists()


def test_an_override_the_workers_engine_cannot_run_is_refused(operator_api: APIClient) -> None:
    reference_only = make_profile(min_prefill_tokens_per_step=32)
    worker, _ = enroll_worker(engine_kind="vllm")
    response = operator_api.patch(
        f"/api/v1/workers/{worker.pk}/", {"desired_revision": reference_only.pk}, format="json"
    )
    assert response.status_code == 400
    assert "min_prefill_tokens_per_step" in response.json()["desired_revision"][0]


def test_moving_a_worker_into_a_pool_whose_revision_it_cannot_run_is_refused(operator_api: APIClient) -> None:
    pool = make_pool(revision=make_profile(short_prompt_threshold=32))
    worker, _ = enroll_worker(engine_kind="vllm")
    response = operator_api.patch(f"/api/v1/workers/{worker.pk}/", {"pool": pool.pk}, format="json")
    assert response.status_code == 400 and "pool" in response.json()


def test_put_and_post_are_not_how_workers_change(operator_api: APIClient) -> None:
    worker, _ = enroll_worker()
    assert operator_api.put(f"/api/v1/workers/{worker.pk}/", {}, format="json").status_code == 405
    assert operator_api.post("/api/v1/workers/", {}, format="json").status_code == 405


def test_delete_forgets_the_worker_and_its_secret(operator_api: APIClient) -> None:
    worker, secret = enroll_worker("gone")
    assert operator_api.delete(f"/api/v1/workers/{worker.pk}/").status_code == 204
    assert Worker.authenticate(secret) is None
    event = AuditEvent.objects.get(action="worker.delete")
    assert event.before["name"] == "gone" and event.object_id == str(worker.pk)
