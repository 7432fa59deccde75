"""Every operation of the OpenAPI document against every kind of caller:
anonymous callers get 401, a viewer may read and never write (403), an
operator may write but not manage enrollment tokens or client keys. The
table is checked against drf-spectacular's generator and every DRF view the
URLconf serves, so an endpoint added without a row here, or without a
named exception, fails this file."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from drf_spectacular.generators import EndpointEnumerator, SchemaGenerator
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import EnrollmentToken
from tests.controlplane.factories import (
    api_client,
    enroll_worker,
    heartbeat_request,
    make_pool,
    make_profile,
    register_request,
)

pytestmark = pytest.mark.django_db

METHODS = ("get", "post", "put", "patch", "delete")
FIGURE = "client_ttft_p99"


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # OpenAPI template, e.g. /api/v1/pools/{id}/
    query: str = ""
    # The least role that may call it; default: viewer reads, operator writes.
    role: Role | None = None
    body: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def needs(self) -> Role:
        if self.role is not None:
            return self.role
        return Role.VIEWER if self.method == "get" else Role.OPERATOR

    def url(self, ids: dict[str, Any]) -> str:
        return (self.path + self.query).format(**ids)


def _crud(path: str, *, role: Role | None = None, methods: str = "get post get_one put patch delete") -> list[Endpoint]:
    """Rows of a model viewset; ``role``: the least role for every one of them."""
    rows = []
    for m in methods.split():
        if m in ("get", "post"):
            rows.append(Endpoint(m, path, role=role))
        else:
            rows.append(Endpoint(m.replace("_one", ""), path + "{id}/", role=role))
    return rows


def _actions(path: str, *names: str) -> list[Endpoint]:
    return [Endpoint("post", f"{path}{{id}}/{name}/") for name in names]


DRAFT_RULE = {"name": "Draft", "figure": FIGURE, "window_seconds": 300, "comparator": ">", "threshold": 1.0}

ENDPOINTS = [
    Endpoint("get", "/api/v1/me/"),
    Endpoint("get", "/api/v1/audit/"),
    Endpoint("get", "/api/v1/audit/{id}/"),
    # fleet and profiles
    *_crud("/api/v1/pools/"),
    *_crud("/api/v1/profiles/"),
    Endpoint("get", "/api/v1/profiles/{id}/revisions/"),
    Endpoint("get", "/api/v1/profiles/{id}/diff/"),
    Endpoint("get", "/api/v1/profile-revisions/"),
    Endpoint("get", "/api/v1/profile-revisions/{id}/"),
    Endpoint("get", "/api/v1/profile-revisions/{id}/diff/", query="?to={to}"),
    *_crud("/api/v1/workers/", methods="get get_one patch delete"),
    *_actions("/api/v1/workers/", "drain", "undrain", "cordon", "uncordon"),
    # Credentials: only admins issue, change or revoke them; client keys are
    # admin-only even to read.
    Endpoint("get", "/api/v1/enrollment-tokens/"),
    Endpoint("get", "/api/v1/enrollment-tokens/{id}/"),
    *_crud("/api/v1/enrollment-tokens/", role=Role.ADMIN, methods="post put patch delete"),
    *_crud("/api/v1/client-keys/", role=Role.ADMIN),
    # routing and gateways
    Endpoint("get", "/api/v1/routing/"),
    Endpoint("get", "/api/v1/routing/{model}/"),
    Endpoint("put", "/api/v1/routing/{model}/"),
    Endpoint("patch", "/api/v1/routing/{model}/"),
    Endpoint("delete", "/api/v1/routing/{model}/"),
    Endpoint("get", "/api/v1/routing/{model}/acks/"),
    Endpoint("get", "/api/v1/gateways/"),
    Endpoint("get", "/api/v1/requests/"),
    Endpoint("get", "/api/v1/requests/export/"),
    Endpoint("get", "/api/v1/requests/{id}/"),
    # metrics
    Endpoint("get", "/api/v1/metrics/figures/"),
    Endpoint("get", "/api/v1/metrics/query/", query=f"?figure={FIGURE}"),
    Endpoint("get", "/api/v1/metrics/query_range/", query=f"?figure={FIGURE}&range=10m"),
    Endpoint("get", "/api/v1/metrics/objectives/"),
    Endpoint("put", "/api/v1/metrics/objectives/"),
    Endpoint("get", "/api/v1/metrics/targets/"),
    Endpoint("get", "/api/v1/metrics/prometheus-sd/"),
    Endpoint("get", "/metrics/"),
    # advisor
    Endpoint("get", "/api/v1/advisor/reports/"),
    Endpoint("get", "/api/v1/advisor/reports/{scope}/"),
    # rollouts
    *_crud("/api/v1/analysis-templates/"),
    *_crud("/api/v1/rollouts/", methods="get post get_one delete"),
    *_actions("/api/v1/rollouts/", "abort", "promote", "promote-full", "retry", "rollback", "skip-step"),
    # experiments
    *_crud("/api/v1/workloads/", methods="get post get_one delete"),
    *_crud("/api/v1/experiments/", methods="get post get_one"),
    *_actions("/api/v1/experiments/", "abort", "adopt", "verify"),
    # alerts
    *_crud("/api/v1/alert-rules/"),
    Endpoint("get", "/api/v1/alert-rules/{id}/test/"),
    # Evaluates a rule that is not saved and writes nothing: a viewer may.
    Endpoint("post", "/api/v1/alert-rules/test/", role=Role.VIEWER, body=DRAFT_RULE),
    Endpoint("get", "/api/v1/alerts/"),
    Endpoint("get", "/api/v1/alerts/{id}/"),
    # Alertmanager authenticates with an operator's API token (no auth of its own).
    Endpoint("post", "/api/v1/alerts/webhook/"),
    *_crud("/api/v1/silences/"),
    *_crud("/api/v1/alert-receivers/"),
    *_crud("/api/v1/alert-routes/"),
]

# Operations that do not take a user's API token, and why. Each is tested
# below to refuse a missing or wrong credential of its own kind.
OWN_AUTH = {
    ("post", "/api/v1/agent/register/"): "an agent trades an enrollment token (in the body) for a worker secret",
    ("post", "/api/v1/agent/heartbeat/"): "an agent authenticates with its worker secret (Bearer)",
}
# DRF views the URLconf serves outside the OpenAPI document, and why.
PUBLIC_UNDOCUMENTED = {
    ("get", "/api/schema/"): "the OpenAPI document itself: describes the API, holds no data",
    ("get", "/api/docs/"): "Swagger UI over that document",
}


@pytest.fixture
def ids() -> dict[str, dict[str, Any]]:
    """One of everything; path parameters per resource path prefix."""
    from controlplane.alerts.lifecycle import AlertState
    from controlplane.alerts.models import Alert, AlertRule, Receiver, Route, Silence
    from controlplane.experiments.models import Experiment, Workload
    from controlplane.gateway.models import ClientKey, RequestLog, RoutingPool, RoutingTable
    from controlplane.rollouts.models import AnalysisTemplate, Rollout

    now = timezone.now()
    revision = make_profile("access")
    other = revision.profile.add_revision({"max_num_batched_tokens": 1024})
    pool, canary = make_pool("access", revision), make_pool("access-canary", revision)
    worker, _ = enroll_worker("access-worker", pool=pool)
    token, _ = EnrollmentToken.issue("access")
    event = AuditEvent.objects.first()
    table = RoutingTable.objects.create(model="access-model")
    RoutingPool.objects.create(table=table, pool=pool, role="stable", weight_bp=10000)
    key, _ = ClientKey.issue("access")
    rollout = Rollout.objects.create(
        routing_table=table, stable_pool=pool, canary_pool=canary, stable_revision=revision, target_revision=other
    )
    alert = Alert.objects.create(
        fingerprint="a" * 16, labels={"alertname": "Access"}, state=AlertState.FIRING, fired_at=now
    )
    silence = Silence.objects.create(
        matchers=[{"name": "alertname", "value": "Access", "isRegex": False, "isEqual": True}],
        starts_at=now,
        ends_at=now + timedelta(hours=1),
        created_by="x",
        comment="c",
    )
    receiver = Receiver.objects.create(name="access-hook", kind=Receiver.KIND_WEBHOOK, url="http://127.0.0.1:9/")
    route = Route.objects.create(receiver=receiver)
    workload = Workload.from_scenario(name="access", scenario="burst", rate=1.0, duration_seconds=10)
    lab_worker, _ = enroll_worker("access-lab-worker", pool=make_pool("access-lab", revision))
    experiment = Experiment.create(name="access", workload=workload, workers=[lab_worker])
    logged = RequestLog.objects.create(request_id="access", created_at=now, model="access-model", status=200)
    return {
        "/api/v1/requests/": {"id": logged.pk},
        "/api/v1/audit/": {"id": event.pk},
        "/api/v1/pools/": {"id": pool.pk},
        "/api/v1/profiles/": {"id": revision.profile_id},
        "/api/v1/profile-revisions/": {"id": revision.pk, "to": other.pk},
        "/api/v1/workers/": {"id": worker.pk},
        "/api/v1/enrollment-tokens/": {"id": token.pk},
        "/api/v1/client-keys/": {"id": key.pk},
        "/api/v1/routing/": {"model": table.model},
        "/api/v1/analysis-templates/": {"id": AnalysisTemplate.default().pk},
        "/api/v1/rollouts/": {"id": rollout.pk},
        "/api/v1/alert-rules/": {"id": AlertRule.objects.first().pk},
        "/api/v1/alerts/": {"id": alert.pk},
        "/api/v1/silences/": {"id": silence.pk},
        "/api/v1/alert-receivers/": {"id": receiver.pk},
        "/api/v1/alert-routes/": {"id": route.pk},
        "/api/v1/workloads/": {"id": workload.pk},
        "/api/v1/experiments/": {"id": experiment.pk},
        "/api/v1/advisor/": {"scope": "fleet"},
    }


def _call(client: APIClient, endpoint: Endpoint, ids: dict[str, dict[str, Any]]) -> Any:
    prefix = next((p for p in ids if endpoint.path.startswith(p)), None)
    url = endpoint.url(ids.get(prefix, {}) if prefix else {})
    if endpoint.method == "get":
        response = client.get(url)
    else:
        response = getattr(client, endpoint.method)(url, endpoint.body, format="json")
    if getattr(response, "streaming", False):
        # Read and close a streamed reply as a server would: the request
        # export holds a COPY open on the test's connection until it is.
        b"".join(response.streaming_content)
        response.close()
    return response


def _name(endpoint: Endpoint) -> str:
    return f"{endpoint.method.upper()} {endpoint.path}"


def _documented() -> set[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {(method, path) for path, ops in schema["paths"].items() for method in ops if method in METHODS}


def test_the_table_covers_every_operation_in_the_openapi_document(db: Any) -> None:
    tabled = [(e.method, e.path) for e in ENDPOINTS]
    assert len(tabled) == len(set(tabled)), "a row is listed twice"
    assert _documented() == set(tabled) | set(OWN_AUTH)


def test_every_api_view_is_in_the_openapi_document_or_named_public(db: Any) -> None:
    # A view left out of the schema (extend_schema(exclude=True)) must not
    # slip past the table above.
    served = {(m.lower(), p.replace("{pk}", "{id}")) for p, _, m, _ in EndpointEnumerator().get_api_endpoints()}
    assert served == _documented() | set(PUBLIC_UNDOCUMENTED)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=_name)
def test_anonymous_callers_get_401(anon_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    before = AuditEvent.objects.count()
    response = _call(anon_api, endpoint, ids)
    assert response.status_code == 401, response.content
    assert response.has_header("WWW-Authenticate")
    assert AuditEvent.objects.count() == before


@pytest.mark.parametrize("method_path", sorted(PUBLIC_UNDOCUMENTED), ids=" ".join)
def test_the_api_description_is_public(anon_api: APIClient, method_path: tuple[str, str]) -> None:
    assert anon_api.get(method_path[1]).status_code == 200


def test_a_wrong_api_token_gets_401(ids: dict) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert client.get("/api/v1/pools/").status_code == 401


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.needs > Role.VIEWER], ids=_name)
def test_viewers_may_not_write(viewer_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    before = AuditEvent.objects.count()
    response = _call(viewer_api, endpoint, ids)
    assert response.status_code == 403, response.content
    assert AuditEvent.objects.count() == before


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.needs == Role.VIEWER], ids=_name)
def test_viewers_may_read(viewer_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    response = _call(viewer_api, endpoint, ids)
    assert response.status_code == 200, response.content


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.needs == Role.ADMIN], ids=_name)
def test_operators_may_not_manage_credentials(operator_api: APIClient, ids: dict, endpoint: Endpoint) -> None:
    before = AuditEvent.objects.count()
    assert _call(operator_api, endpoint, ids).status_code == 403
    assert AuditEvent.objects.count() == before


@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if e.needs > Role.VIEWER], ids=_name)
def test_the_least_role_named_gets_past_the_permission_check(
    operator_api: APIClient, admin_api: APIClient, ids: dict, endpoint: Endpoint
) -> None:
    # With an empty body most of these answer 400: what matters is that the
    # role is let through and nothing breaks.
    client = admin_api if endpoint.needs == Role.ADMIN else operator_api
    response = _call(client, endpoint, ids)
    assert response.status_code not in (401, 403), response.content
    assert response.status_code < 500, response.content


# ---- the agent endpoints' own credentials --------------------------------------------------


def test_agent_endpoints_are_the_only_ones_with_their_own_auth() -> None:
    assert set(OWN_AUTH) == {("post", "/api/v1/agent/register/"), ("post", "/api/v1/agent/heartbeat/")}


@pytest.mark.parametrize("path", ["/api/v1/agent/register/", "/api/v1/agent/heartbeat/"])
def test_agent_endpoints_refuse_a_call_without_a_credential(anon_api: APIClient, path: str) -> None:
    response = anon_api.post(path, {}, format="json")
    assert response.status_code == 401, response.content
    assert response.has_header("WWW-Authenticate")


def test_registering_with_a_wrong_enrollment_token_is_refused(anon_api: APIClient) -> None:
    response = anon_api.post("/api/v1/agent/register/", register_request("not-a-token", "intruder"), format="json")
    assert response.status_code == 401, response.content
    from controlplane.fleet.models import Worker

    assert not Worker.objects.filter(name="intruder").exists()


@pytest.mark.parametrize("header", ["Bearer not-a-secret", "Token not-a-secret", "Bearer"])
def test_a_heartbeat_with_a_wrong_worker_secret_is_refused(anon_api: APIClient, header: str) -> None:
    anon_api.credentials(HTTP_AUTHORIZATION=header)
    assert anon_api.post("/api/v1/agent/heartbeat/", heartbeat_request(), format="json").status_code == 401


def test_a_users_api_token_is_no_worker_secret(viewer: Any, admin_user: Any) -> None:
    response = api_client(admin_user).post("/api/v1/agent/heartbeat/", heartbeat_request(), format="json")
    assert response.status_code == 401


def test_a_worker_secret_is_no_api_token(db: Any) -> None:
    _, secret = enroll_worker("secret-holder", pool=make_pool("secret-pool"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert client.get("/api/v1/pools/").status_code == 401
    client.credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    assert client.get("/api/v1/pools/").status_code == 401


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
