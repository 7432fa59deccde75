from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Pool
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db


def test_create_a_pool_with_a_desired_revision_and_audit_it(operator_api: APIClient, operator: Any) -> None:
    revision = make_profile("stable")
    response = operator_api.post("/api/v1/pools/", {"name": "stable", "desired_revision": revision.pk}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["desired"] == {"id": revision.pk, "name": "stable", "revision": 1, "label": "stable@1"}
    event = AuditEvent.objects.get(action="pool.create")
    assert event.actor == operator and event.after["desired_revision"] == revision.pk


@pytest.mark.parametrize(
    ("body", "bad_field"),
    [
        ({}, "name"),
        ({"name": "a b"}, "name"),
        ({"name": "dup"}, "name"),
        ({"name": "x", "desired_revision": 999999}, "desired_revision"),
    ],
)
def test_create_with_bad_input_is_400_by_field(operator_api: APIClient, body: dict, bad_field: str) -> None:
    make_pool("dup")
    response = operator_api.post("/api/v1/pools/", body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()
    assert not AuditEvent.objects.filter(action="pool.create").exists()


def test_pointing_a_pool_at_a_new_revision_starts_its_workers_drift_clocks(operator_api: APIClient) -> None:
    old = make_profile("p")
    new = old.profile.add_revision({"max_num_batched_tokens": 1024})
    pool = make_pool("canary", old)
    worker, _ = enroll_worker(pool=pool)
    worker.record_heartbeat(
        {
            "contract_version": 1,
            "state": "ready",
            "load": {},
            "running_revision_id": old.pk,
            "running_profile": {},
            "hardware": {},
            "apply_error": None,
        }
    )
    worker.refresh_from_db()
    assert worker.drift_since is None
    response = operator_api.patch(f"/api/v1/pools/{pool.pk}/", {"desired_revision": new.pk}, format="json")
    assert response.status_code == 200, response.content
    worker.refresh_from_db()
    assert worker.drift_since is not None
    event = AuditEvent.objects.get(action="pool.update")
    assert (event.before["desired_revision"], event.after["desired_revision"]) == (old.pk, new.pk)


def test_put_replaces_a_pool_and_audits_it(operator_api: APIClient, operator: Any) -> None:
    old = make_profile("put-old")
    new = old.profile.add_revision({"max_num_batched_tokens": 1024})
    pool = make_pool("put-me", old)
    response = operator_api.put(
        f"/api/v1/pools/{pool.pk}/",
        {"name": "put-me", "description": "replaced", "desired_revision": new.pk},
        format="json",
    )
    assert response.status_code == 200, response.content
    assert response.json()["desired"]["id"] == new.pk and response.json()["description"] == "replaced"
    event = AuditEvent.objects.get(action="pool.update")
    assert event.actor == operator
    assert (event.before["desired_revision"], event.after["desired_revision"]) == (old.pk, new.pk)
    assert (event.before["description"], event.after["description"]) == ("", "replaced")


@pytest.mark.parametrize(
    ("body", "bad_field"),
    [
        ({}, "name"),
        ({"name": "a b"}, "name"),
        ({"name": "dup"}, "name"),
        ({"name": "put-me", "desired_revision": 999999}, "desired_revision"),
    ],
)
def test_put_with_bad_input_is_400_by_field_and_changes_nothing(
    operator_api: APIClient, body: dict, bad_field: str
) -> None:
    make_pool("dup")
    pool = make_pool("put-me")
    response = operator_api.put(f"/api/v1/pools/{pool.pk}/", body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()
    pool.refresh_from_db()
    assert (pool.name, pool.desired_revision) == ("put-me", None)
    assert not AuditEvent.objects.filter(action="pool.update").exists()


def test_a_revision_a_pools_worker_cannot_run_is_refused(operator_api: APIClient) -> None:
    chunky = make_profile("ref-only", short_prompt_threshold=64)
    pool = make_pool("vllm-pool")
    enroll_worker("vllm-1", pool=pool, engine_kind="vllm")
    response = operator_api.patch(f"/api/v1/pools/{pool.pk}/", {"desired_revision": chunky.pk}, format="json")
    assert response.status_code == 400
    assert "vllm-1" in response.json()["desired_revision"][0]
    assert "short_prompt_threshold" in response.json()["desired_revision"][0]
    pool.refresh_from_db()
    assert pool.desired_revision is None


def test_a_monolithic_revision_too_small_for_a_workers_model_is_refused(operator_api: APIClient) -> None:
    mono = make_profile("mono", prefill_mode="monolithic", max_num_batched_tokens=1024)
    pool = make_pool()
    enroll_worker("long-ctx", pool=pool, max_model_len=4096)
    response = operator_api.patch(f"/api/v1/pools/{pool.pk}/", {"desired_revision": mono.pk}, format="json")
    assert response.status_code == 400
    assert "max length (4096)" in response.json()["desired_revision"][0]


def test_delete_an_empty_pool_and_audit_it(operator_api: APIClient) -> None:
    pool = make_pool("empty")
    assert operator_api.delete(f"/api/v1/pools/{pool.pk}/").status_code == 204
    assert not Pool.objects.filter(pk=pool.pk).exists()
    assert AuditEvent.objects.get(action="pool.delete").before["name"] == "empty"


def test_a_pool_with_workers_cannot_be_deleted(operator_api: APIClient) -> None:
    pool = make_pool("busy")
    enroll_worker("busy-1", pool=pool)
    response = operator_api.delete(f"/api/v1/pools/{pool.pk}/")
    assert response.status_code == 409
    assert response.json()["in_use_by"] == ["worker busy-1"]
    assert not AuditEvent.objects.filter(action="pool.delete").exists()


def test_list_counts_each_pools_workers(viewer_api: APIClient) -> None:
    pool = make_pool("counted")
    enroll_worker(pool=pool)
    enroll_worker(pool=pool)
    body = viewer_api.get("/api/v1/pools/").json()
    assert [(p["name"], p["num_workers"]) for p in body["results"]] == [("counted", 2)]
