"""The OpenAPI document tells the truth where the fuzzers found it did not
(issue 27): fields that come back null say so, every operation lists its
error replies, and inputs that break the document are refused. The fuzz
(``test_api_fuzz.py``) checks every operation; these name each case."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.fleet.models import EnrollmentToken
from tests.controlplane.rollouts.factories import make_fleet

pytestmark = pytest.mark.django_db


@pytest.fixture
def document(admin_api: APIClient) -> dict[str, Any]:
    return admin_api.get("/api/schema/?format=json").json()


@pytest.mark.parametrize(
    ("component", "field"),
    [
        ("Alert", "starts_at"),
        ("Alert", "ends_at"),
        ("EnrollmentToken", "created_by"),
        ("Rollout", "baseline_pool"),
        ("Rollout", "created_by"),
    ],
)
def test_fields_that_come_back_null_are_nullable_in_the_document(
    document: dict[str, Any], component: str, field: str
) -> None:
    assert document["components"]["schemas"][component]["properties"][field].get("nullable") is True


def test_every_operation_lists_its_error_replies(document: dict[str, Any]) -> None:
    missing = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            expected = {"400", "401", "403"} | ({"404"} if "{" in path else set())
            expected |= {"409"} if method == "delete" else set()
            if lacking := expected - set(operation["responses"]):
                missing.append(f"{method.upper()} {path}: {sorted(lacking)}")
    assert not missing, missing
    error = document["components"]["schemas"]["Error"]
    assert error["type"] == "object" and error["additionalProperties"] is True


@pytest.mark.parametrize("query", ["drifting=maybe", "drifting=", "drifting=null", "state=", "state=sleepy"])
def test_a_worker_filter_that_is_not_one_of_its_values_is_a_400_naming_it(admin_api: APIClient, query: str) -> None:
    response = admin_api.get(f"/api/v1/workers/?{query}")
    assert response.status_code == 400 and query.split("=")[0] in response.json()


def test_the_worker_filters_still_filter(admin_api: APIClient) -> None:
    make_fleet("schema-model")
    assert admin_api.get("/api/v1/workers/?drifting=false&state=ready").json()["count"] == 3
    assert admin_api.get("/api/v1/workers/?drifting=true").json()["count"] == 0


@pytest.mark.parametrize("body", [b"true", b"false", b"1", b"[]"])
def test_abort_refuses_a_body_that_is_not_an_object(admin_api: APIClient, body: bytes) -> None:
    fleet = make_fleet("abort-model")
    created = admin_api.post(
        "/api/v1/rollouts/",
        {
            "model": fleet.table.model,
            "stable_pool": fleet.stable.name,
            "canary_pool": fleet.canary.name,
            "target_revision": fleet.target_revision.pk,
        },
        format="json",
    )
    response = admin_api.generic(
        "POST", f"/api/v1/rollouts/{created.json()['id']}/abort/", body, content_type="application/json"
    )
    assert response.status_code == 400


def test_the_webhooks_text_fields_must_be_text_when_sent(operator_api: APIClient) -> None:
    response = operator_api.post("/api/v1/alerts/webhook/", {"groupKey": 7, "alerts": []}, format="json")
    assert response.status_code == 400 and set(response.json()) == {"groupKey"}
    assert operator_api.post("/api/v1/alerts/webhook/", {"alerts": []}, format="json").status_code == 200


def test_text_longer_than_its_max_length_as_sent_is_refused_before_trimming(admin_api: APIClient) -> None:
    response = admin_api.post("/api/v1/enrollment-tokens/", {"name": "\u00a0" + "*" * 100}, format="json")
    assert response.status_code == 400 and "name" in response.json()
    assert admin_api.post("/api/v1/enrollment-tokens/", {"name": "*" * 100}, format="json").status_code == 201


def test_the_rollouts_active_filter_is_true_or_false(admin_api: APIClient) -> None:
    response = admin_api.get("/api/v1/rollouts/?active=0.3")
    assert response.status_code == 400 and "active" in response.json()
    assert admin_api.get("/api/v1/rollouts/?active=true").status_code == 200


def test_an_empty_request_log_filter_is_no_filter_and_the_document_says_so(
    admin_api: APIClient, document: dict[str, Any]
) -> None:
    (parameter,) = [
        p for p in document["paths"]["/api/v1/requests/"]["get"]["parameters"] if p["name"] == "prefill_mode"
    ]
    assert "" in parameter["schema"]["enum"]
    assert admin_api.get("/api/v1/requests/?prefill_mode=").status_code == 200
    assert admin_api.get("/api/v1/requests/?prefill_mode=sideways").status_code == 400


def test_a_number_where_the_document_says_text_is_refused(admin_api: APIClient) -> None:
    response = admin_api.post("/api/v1/pools/", {"name": "p-number", "description": 6675.0}, format="json")
    assert response.status_code == 400 and set(response.json()) == {"description"}
    assert admin_api.post("/api/v1/pools/", {"name": "p-text", "description": "6675"}, format="json").status_code == 201


def test_a_partial_update_still_answers_every_field_a_null_creator_included(admin_api: APIClient) -> None:
    created = admin_api.post("/api/v1/enrollment-tokens/", {"name": "t"}, format="json").json()
    EnrollmentToken.objects.filter(pk=created["id"]).update(created_by=None)
    response = admin_api.patch(f"/api/v1/enrollment-tokens/{created['id']}/", {"name": "t2"}, format="json")
    assert response.status_code == 200 and response.json()["created_by"] is None


@pytest.mark.parametrize("path", ["/api/v1/requests/", "/api/v1/workers/", "/api/v1/rollouts/"])
def test_a_query_parameter_sent_as_an_object_is_a_400_naming_it(admin_api: APIClient, path: str) -> None:
    response = admin_api.get(f"{path}?limit[a]=1&limit[b]=2")
    assert response.status_code == 400 and response.json() == {"limit": ["must be a single value, not an object."]}
    assert admin_api.get(f"{path}?limit=1").status_code == 200
