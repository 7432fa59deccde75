from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.profiles.models import Profile
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db


def test_create_makes_revision_one_and_audits_it(operator_api: APIClient, operator: Any) -> None:
    response = operator_api.post(
        "/api/v1/profiles/",
        {
            "name": "chunked-512",
            "engine_kind": "reference",
            "fields": {"max_num_batched_tokens": 512},
            "comment": "first",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["latest_revision"]["revision"] == 1
    assert body["latest_revision"]["fields"]["max_num_batched_tokens"] == 512
    assert body["latest_revision"]["author"] == operator.username
    event = AuditEvent.objects.get(action="profile.create")
    assert event.actor == operator and event.before is None
    assert event.after["name"] == "chunked-512" and event.after["revision"] == 1


@pytest.mark.parametrize(
    ("fields", "engine_kind", "bad_field"),
    [
        ({"max_num_batched_tokens": 32, "max_num_seqs": 64}, "reference", "max_num_batched_tokens"),
        (
            {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 300},
            "reference",
            "long_prefill_token_threshold",
        ),
        ({"max_num_batched_tokens": 0}, "reference", "max_num_batched_tokens"),
        ({"max_num_seqs": -4}, "reference", "max_num_seqs"),
        ({"short_prompt_threshold": 64}, "vllm", "short_prompt_threshold"),
        ({"prefill_mode": "sideways"}, "reference", "prefill_mode"),
        ({"max_num_seqs": "many"}, "reference", "max_num_seqs"),
        ({"no_such_knob": 1}, "reference", "no_such_knob"),
    ],
)
def test_create_refuses_a_broken_profile_with_field_errors(
    operator_api: APIClient, fields: dict, engine_kind: str, bad_field: str
) -> None:
    response = operator_api.post(
        "/api/v1/profiles/", {"name": "broken", "engine_kind": engine_kind, "fields": fields}, format="json"
    )
    assert response.status_code == 400
    assert bad_field in response.json()
    assert not Profile.objects.filter(name="broken").exists()
    assert not AuditEvent.objects.filter(action="profile.create").exists()


@pytest.mark.parametrize(
    ("body", "bad_field"),
    [
        ({"engine_kind": "reference"}, "name"),
        ({"name": "has spaces"}, "name"),
        ({"name": "ok", "engine_kind": "tpu"}, "engine_kind"),
        ({"name": "ok", "fields": [1, 2]}, "fields"),
    ],
)
def test_create_refuses_bad_metadata_with_field_errors(operator_api: APIClient, body: dict, bad_field: str) -> None:
    response = operator_api.post("/api/v1/profiles/", body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()


def test_patch_merges_into_the_latest_revision_and_adds_the_next(operator_api: APIClient) -> None:
    revision = make_profile("merge", max_num_batched_tokens=1024, max_num_seqs=32)
    response = operator_api.patch(
        f"/api/v1/profiles/{revision.profile_id}/",
        {"fields": {"long_prefill_token_threshold": 256}, "comment": "cap chunks"},
        format="json",
    )
    assert response.status_code == 200, response.content
    latest = response.json()["latest_revision"]
    assert latest["revision"] == 2 and latest["comment"] == "cap chunks"
    assert latest["fields"]["max_num_seqs"] == 32
    assert latest["fields"]["long_prefill_token_threshold"] == 256
    event = AuditEvent.objects.get(action="profile.update")
    assert (event.before["revision"], event.after["revision"]) == (1, 2)
    assert event.before["fields"]["long_prefill_token_threshold"] is None


def test_put_replaces_the_fields_missing_knobs_take_defaults(operator_api: APIClient) -> None:
    revision = make_profile("replace", max_num_batched_tokens=1024, max_num_seqs=32)
    response = operator_api.put(
        f"/api/v1/profiles/{revision.profile_id}/",
        {"name": "replace", "engine_kind": "reference", "fields": {"max_num_batched_tokens": 2048}},
        format="json",
    )
    assert response.status_code == 200, response.content
    assert response.json()["latest_revision"]["fields"]["max_num_seqs"] == 64
    event = AuditEvent.objects.get(action="profile.update")
    assert (event.before["revision"], event.after["revision"]) == (1, 2)
    assert (event.before["fields"]["max_num_batched_tokens"], event.after["fields"]["max_num_batched_tokens"]) == (
        1024,
        2048,
    )


def test_an_edit_that_changes_no_knob_adds_no_revision(operator_api: APIClient) -> None:
    revision = make_profile("same", max_num_batched_tokens=1024)
    response = operator_api.patch(
        f"/api/v1/profiles/{revision.profile_id}/",
        {"fields": {"max_num_batched_tokens": 1024}, "description": "just words"},
        format="json",
    )
    assert response.status_code == 200
    assert response.json()["num_revisions"] == 1 and response.json()["description"] == "just words"


def test_an_invalid_edit_is_refused_and_adds_nothing(operator_api: APIClient) -> None:
    revision = make_profile("guarded", max_num_batched_tokens=512)
    response = operator_api.patch(
        f"/api/v1/profiles/{revision.profile_id}/", {"fields": {"long_prefill_token_threshold": 4096}}, format="json"
    )
    assert response.status_code == 400
    assert "long_prefill_token_threshold" in response.json()
    assert revision.profile.revisions.count() == 1
    assert not AuditEvent.objects.filter(action="profile.update").exists()


def test_monolithic_budget_below_a_running_workers_model_length_is_refused(operator_api: APIClient) -> None:
    revision = make_profile("mono", prefill_mode="monolithic", max_num_batched_tokens=2048)
    enroll_worker(pool=make_pool(revision=revision), max_model_len=2048)
    response = operator_api.patch(
        f"/api/v1/profiles/{revision.profile_id}/", {"fields": {"max_num_batched_tokens": 1024}}, format="json"
    )
    assert response.status_code == 400
    assert "max length (2048)" in response.json()["max_num_batched_tokens"][0]


@pytest.mark.parametrize(("field", "value"), [("engine_kind", "vllm"), ("name", "renamed")])
def test_engine_kind_and_name_cannot_change(operator_api: APIClient, field: str, value: str) -> None:
    revision = make_profile("kind")
    response = operator_api.patch(f"/api/v1/profiles/{revision.profile_id}/", {field: value}, format="json")
    assert response.status_code == 400
    assert field in response.json()


def test_delete_removes_an_unused_profile_and_audits_it(operator_api: APIClient) -> None:
    revision = make_profile("doomed")
    assert operator_api.delete(f"/api/v1/profiles/{revision.profile_id}/").status_code == 204
    assert not Profile.objects.filter(name="doomed").exists()
    event = AuditEvent.objects.get(action="profile.delete")
    assert event.before["name"] == "doomed" and event.after is None


def test_a_profile_a_pool_wants_cannot_be_deleted(operator_api: APIClient) -> None:
    revision = make_profile("wanted")
    make_pool("wanting", revision)
    response = operator_api.delete(f"/api/v1/profiles/{revision.profile_id}/")
    assert response.status_code == 409
    assert any("wanting" in holder for holder in response.json()["in_use_by"])
    assert Profile.objects.filter(name="wanted").exists()
    assert not AuditEvent.objects.filter(action="profile.delete").exists()


def test_revisions_lists_newest_first(viewer_api: APIClient) -> None:
    revision = make_profile("listed")
    revision.profile.add_revision({"max_num_batched_tokens": 1024})
    body = viewer_api.get(f"/api/v1/profiles/{revision.profile_id}/revisions/").json()
    assert [r["revision"] for r in body["results"]] == [2, 1]


def test_diff_defaults_to_latest_against_the_one_before(viewer_api: APIClient) -> None:
    revision = make_profile("diffed", max_num_batched_tokens=512)
    revision.profile.add_revision({"max_num_batched_tokens": 1024})
    revision.profile.add_revision({"max_num_batched_tokens": 1024, "enable_prefix_caching": False})
    body = viewer_api.get(f"/api/v1/profiles/{revision.profile_id}/diff/").json()
    assert (body["before"]["revision"], body["after"]["revision"]) == (2, 3)
    assert body["changes"] == [{"field": "enable_prefix_caching", "before": True, "after": False}]
    body = viewer_api.get(f"/api/v1/profiles/{revision.profile_id}/diff/?from=1&to=3").json()
    assert [c["field"] for c in body["changes"]] == ["max_num_batched_tokens", "enable_prefix_caching"]


@pytest.mark.parametrize(("query", "bad_field"), [("?from=9", "from"), ("?to=9", "to"), ("?to=x", "to")])
def test_diff_with_a_missing_revision_is_a_field_error(viewer_api: APIClient, query: str, bad_field: str) -> None:
    revision = make_profile("short")
    response = viewer_api.get(f"/api/v1/profiles/{revision.profile_id}/diff/{query}")
    assert response.status_code == 400
    assert bad_field in response.json()


def test_any_two_revisions_diff_by_id(viewer_api: APIClient) -> None:
    a = make_profile(max_num_seqs=32)
    b = make_profile(engine_kind="vllm", max_num_seqs=16)
    body = viewer_api.get(f"/api/v1/profile-revisions/{a.pk}/diff/?to={b.pk}").json()
    assert body["changes"] == [{"field": "max_num_seqs", "before": 32, "after": 16}]
    assert viewer_api.get(f"/api/v1/profile-revisions/{a.pk}/diff/").status_code == 400
