"""Every endpoint of the core API against every kind of caller: anonymous
callers get 401, viewers may read and never write (403), operators may not
manage enrollment tokens. The table is checked against the OpenAPI document,
so an endpoint added without a row here fails this file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import EnrollmentToken
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db

PREFIXES = ("/api/v1/me/", "/api/v1/audit/", "/api/v1/pools/", "/api/v1/profiles/",
            "/api/v1/profile-revisions/", "/api/v1/workers/", "/api/v1/enrollment-tokens/", "/api/v1/agent/")


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # OpenAPI template, e.g. /api/v1/pools/{id}/
    query: str = ""
    admin_only: bool = False

    @property
    def writes(self) -> bool:
        return self.method not in ("get", "head", "options")

    def url(self, ids: dict[str, Any]) -> str:
        return (self.path + self.query).format(**ids)


def _crud(path: str, *, admin_only: bool = False, methods: str = "get post get_one put patch delete") -> list[Endpoint]:
    rows = []
    for m in methods.split():
        if m in ("get", "post"):
            rows.append(Endpoint(m, path, admin_only=admin_only and m == "post"))
        else:
            rows.append(Endpoint(m.replace("_one", ""), path + "{id}/", admin_only=admin_only and m != "get_one"))
    return rows


ENDPOINTS = [
    Endpoint("get", "/api/v1/me/"),
    Endpoint("get", "/api/v1/audit/"),
    Endpoint("get", "/api/v1/audit/{id}/"),
    *_crud("/api/v1/pools/"),
    *_crud("/api/v1/profiles/"),
    Endpoint("get", "/api/v1/profiles/{id}/revisions/"),
    Endpoint("get", "/api/v1/profiles/{id}/diff/"),
    Endpoint("get", "/api/v1/profile-revisions/"),
    Endpoint("get", "/api/v1/profile-revisions/{id}/"),
    Endpoint("get", "/api/v1/profile-revisions/{id}/diff/", query="?to={to}"),
    *_crud("/api/v1/workers/", methods="get get_one patch delete"),
    Endpoint("post", "/api/v1/workers/{id}/drain/"),
    Endpoint("post", "/api/v1/workers/{id}/undrain/"),
    Endpoint("post", "/api/v1/workers/{id}/cordon/"),
    Endpoint("post", "/api/v1/workers/{id}/uncordon/"),
    *_crud("/api/v1/enrollment-tokens/", admin_only=True),
]
AGENT_ENDPOINTS = [Endpoint("post", "/api/v1/agent/register/"), Endpoint("post", "/api/v1/agent/heartbeat/")]


@pytest.fixture
def ids() -> dict[str, dict[str, Any]]:
    """One of everything; ids per resource path prefix."""
    revision = make_profile("access")
    other = revision.profile.add_revision({"max_num_batched_tokens": 1024})
    pool = make_pool("access", revision)
    worker, _ = enroll_worker("access-worker", pool=pool)
    token, _ = EnrollmentToken.issue("access")
    event = AuditEvent.objects.first()
    return {
        "/api/v1/audit/": {"id": event.pk},
        "/api/v1/pools/": {"id": pool.pk},
        "/api/v1/profiles/": {"id": revision.profile_id},
        "/api/v1/profile-revisions/": {"id": revision.pk, "to": other.pk},
        "/api/v1/workers/": {"id": worker.pk},
        "/api/v1/enrollment-tokens/": {"id": token.pk},
    }


def _call(client: APIClient, endpoint: Endpoint, ids: dict[str, dict[str, Any]]) -> Any:
    prefix = next((p for p in ids if endpoint.path.startswith(p)), None)
    url = endpoint.url(ids.get(prefix, {}) if prefix else {})
    if endpoint.method == "get":
        return client.get(url)
    return getattr(client, endpoint.method)(url, {}, format="json")


def _name(endpoint: Endpoint) -> str:
    return f"{endpoint.method.upper()} {endpoint.path}"


def test_the_table_covers_every_core_endpoint_in_the_openapi_document(anon_api: APIClient) -> None:
    schema = anon_api.get("/api/schema/?format=json").json()
    documented = {
        (method, path)
        for path, ops in schema["paths"].items()
        if path.startswith(PREFIXES)
        for method in ops
        if method in ("get", "post", "put", "patch", "delete")
    }
    tabled = {(e.method, e.path) for e in ENDPOINTS + AGENT_ENDPOINTS}
    assert documented == tabled


@pytest.mark.parametrize("endpoint", ENDPOINTS + AGENT_ENDPOINTS, ids=_name)
def test_anonymous_callers_get_401(anon_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    response = _call(anon_api, endpoint, ids)
    assert response.status_code == 401, response.content
    assert response.has_header("WWW-Authenticate")


def test_a_wrong_api_token_gets_401(ids: dict) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert client.get("/api/v1/pools/").status_code == 401


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.writes], ids=_name)
def test_viewers_may_not_write(viewer_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    before = AuditEvent.objects.count()
    response = _call(viewer_api, endpoint, ids)
    assert response.status_code == 403, response.content
    assert AuditEvent.objects.count() == before


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if not e.writes], ids=_name)
def test_viewers_may_read(viewer_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    response = _call(viewer_api, endpoint, ids)
    assert response.status_code == 200, response.content


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.admin_only], ids=_name)
def test_operators_may_not_manage_enrollment_tokens(operator_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    assert _call(operator_api, endpoint, ids).status_code == 403


def test_a_user_without_a_role_may_not_even_read(db: Any) -> None:
    from django.contrib.auth import get_user_model

    from tests.controlplane.factories import api_client

    nobody = get_user_model().objects.create_user("nobody")
    assert api_client(nobody).get("/api/v1/pools/").status_code == 403


def test_me_names_the_callers_role(operator_api: APIClient, operator: Any) -> None:
    assert operator_api.get("/api/v1/me/").json() == {"username": operator.username, "role": "operator"}


def test_createapitoken_prints_a_token_that_works_with_the_role_given(db: Any) -> None:
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("createapitoken", "robot", "--create", "--role", "operator", stdout=out)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {out.getvalue().strip()}")
    assert client.get("/api/v1/me/").json() == {"username": "robot", "role": "operator"}
    assert client.post("/api/v1/pools/", {"name": "made-by-robot"}, format="json").status_code == 201


def test_createapitoken_refuses_an_unknown_user_or_role(db: Any) -> None:
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no user"):
        call_command("createapitoken", "ghost")
    with pytest.raises(CommandError, match="unknown role"):
        call_command("createapitoken", "ghost", "--create", "--role", "emperor")
