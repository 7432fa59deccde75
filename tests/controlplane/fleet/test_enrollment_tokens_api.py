from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import EnrollmentToken
from tests.controlplane.factories import make_pool, register_request
from workers import contract

pytestmark = pytest.mark.django_db


def test_the_token_is_shown_once_and_stored_only_hashed(admin_api: APIClient, admin_user: Any) -> None:
    pool = make_pool("rack")
    response = admin_api.post(
        "/api/v1/enrollment-tokens/", {"name": "rack 4", "pool": pool.pk, "max_uses": 2}, format="json"
    )
    assert response.status_code == 201, response.content
    plaintext = response.json()["token"]
    assert plaintext.startswith("cpe_") and response.json()["created_by"] == admin_user.username
    token = EnrollmentToken.objects.get()
    assert plaintext not in (token.token_hash, token.token_prefix) and plaintext.startswith(token.token_prefix)
    assert admin_api.get(f"/api/v1/enrollment-tokens/{token.pk}/").json()["token"] is None
    event = AuditEvent.objects.get(action="enrollment_token.create")
    assert "token_hash" not in event.after and plaintext not in str(event.after)
    registered = APIClient().post(contract.REGISTER_PATH, register_request(plaintext, "w"), format="json")
    assert registered.status_code == 201


@pytest.mark.parametrize(
    ("body", "bad_field"),
    [
        ({}, "name"),
        ({"name": "t", "max_uses": 0}, "max_uses"),
        ({"name": "t", "pool": 999999}, "pool"),
        ({"name": "t", "expires_at": "yesterday"}, "expires_at"),
        ({"name": "t", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ],
)
def test_create_with_bad_input_is_400_by_field(admin_api: APIClient, body: dict, bad_field: str) -> None:
    response = admin_api.post("/api/v1/enrollment-tokens/", body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()
    assert not EnrollmentToken.objects.exists()


def test_update_limits_a_token_and_audits_it(admin_api: APIClient) -> None:
    token, _ = EnrollmentToken.issue("limit me")
    later = (timezone.now() + timedelta(days=1)).isoformat()
    response = admin_api.patch(
        f"/api/v1/enrollment-tokens/{token.pk}/", {"max_uses": 5, "expires_at": later}, format="json"
    )
    assert response.status_code == 200, response.content
    event = AuditEvent.objects.get(action="enrollment_token.update")
    assert (event.before["max_uses"], event.after["max_uses"]) == (None, 5)


def test_put_replaces_a_tokens_limits_and_audits_it(admin_api: APIClient, admin_user: Any) -> None:
    token, plaintext = EnrollmentToken.issue("replace me", max_uses=3)
    pool = make_pool("rack")
    response = admin_api.put(
        f"/api/v1/enrollment-tokens/{token.pk}/", {"name": "replaced", "pool": pool.pk, "max_uses": 1}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["token"] is None
    event = AuditEvent.objects.get(action="enrollment_token.update")
    assert event.actor == admin_user
    assert (event.before["name"], event.after["name"]) == ("replace me", "replaced")
    assert (event.before["max_uses"], event.after["max_uses"]) == (3, 1)
    assert (event.before["pool"], event.after["pool"]) == (None, pool.pk)
    assert plaintext not in str(event.before) + str(event.after)


BAD_UPDATES = [
    ({"name": "t", "max_uses": 0}, "max_uses"),
    ({"name": "t", "pool": 999999}, "pool"),
    ({"name": "t", "expires_at": "yesterday"}, "expires_at"),
    ({"name": "t", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
]


@pytest.mark.parametrize(
    ("method", "body", "bad_field"),
    # A PUT must name the token; a PATCH without fields is a valid no-op.
    [("put", {}, "name"), *((method, body, field) for method in ("put", "patch") for body, field in BAD_UPDATES)],
)
def test_an_update_with_bad_input_is_400_by_field_and_changes_nothing(
    admin_api: APIClient, method: str, body: dict, bad_field: str
) -> None:
    token, _ = EnrollmentToken.issue("keep me", max_uses=2)
    response = getattr(admin_api, method)(f"/api/v1/enrollment-tokens/{token.pk}/", body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()
    token.refresh_from_db()
    assert (token.name, token.max_uses, token.pool, token.expires_at) == ("keep me", 2, None, None)
    assert not AuditEvent.objects.filter(action="enrollment_token.update").exists()


def test_deleting_a_token_revokes_it(admin_api: APIClient) -> None:
    token, plaintext = EnrollmentToken.issue("revoke me")
    assert admin_api.delete(f"/api/v1/enrollment-tokens/{token.pk}/").status_code == 204
    assert AuditEvent.objects.filter(action="enrollment_token.delete").count() == 1
    registered = APIClient().post(contract.REGISTER_PATH, register_request(plaintext, "w"), format="json")
    assert registered.status_code == 401
