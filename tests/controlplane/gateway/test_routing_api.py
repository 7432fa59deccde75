"""The routing and client-key API: roles, validation by field, audit rows,
epochs. (Acks from real gateways: test_gateway_process.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from rest_framework.test import APIClient

from controlplane.accounts.secrets import hash_secret
from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from controlplane.gateway.models import ClientKey, RoutingTable
from tests.controlplane.factories import make_pool
from tests.controlplane.gateway.factories import pool_spec, ready_worker, routed_model

pytestmark = pytest.mark.django_db


def test_anonymous_calls_are_refused_with_401(anon_api: APIClient) -> None:
    assert anon_api.get("/api/v1/routing/").status_code == 401
    assert anon_api.put("/api/v1/routing/tiny/", {"pools": []}, format="json").status_code == 401
    assert anon_api.get("/api/v1/client-keys/").status_code == 401
    assert anon_api.get("/api/v1/gateways/").status_code == 401


def test_a_viewer_reads_tables_but_may_not_change_them(viewer_api: APIClient) -> None:
    table, pools, _ = routed_model(canary_bp=1000)
    listed = viewer_api.get("/api/v1/routing/")
    assert listed.status_code == 200
    assert listed.json()[0]["pools"] == [
        {"pool": "tiny-canary", "role": "canary", "weight_bp": 1000},
        {"pool": "tiny-stable", "role": "stable", "weight_bp": 9000},
    ]
    assert (
        viewer_api.patch(
            "/api/v1/routing/tiny/", {"weights": {"canary": 0, "stable": 10000}}, format="json"
        ).status_code
        == 403
    )
    body = {"pools": [pool_spec(pools["stable"], "stable", 10000)]}
    assert viewer_api.put("/api/v1/routing/tiny/", body, format="json").status_code == 403
    assert viewer_api.delete("/api/v1/routing/tiny/").status_code == 403
    assert RoutingTable.objects.get().weights() == {"canary": 1000, "stable": 9000}


def test_put_creates_a_table_bumps_the_epoch_and_audits_it(operator_api: APIClient, operator: Any) -> None:
    stable, canary = make_pool("stable"), make_pool("canary")
    ready_worker(stable)
    ready_worker(canary)
    body = {"pools": [pool_spec(stable, "stable", 9000), pool_spec(canary, "canary", 1000)], "reason": "first table"}
    response = operator_api.put("/api/v1/routing/org/tiny-v2/", body, format="json")
    assert response.status_code == 201, response.content
    data = response.json()
    assert data["model"] == "org/tiny-v2" and data["epoch"] == 2
    assert data["acks"]["epoch"] == 2
    event = AuditEvent.objects.get(action="routing.configure")
    assert event.actor == operator
    assert event.before["pools"] == []
    assert event.after["pools"] == [
        {"pool": "canary", "role": "canary", "weight_bp": 1000},
        {"pool": "stable", "role": "stable", "weight_bp": 9000},
    ]
    assert event.after["reason"] == "first table"
    # The same PUT again changes nothing: same epoch, no new audit row.
    again = operator_api.put("/api/v1/routing/org/tiny-v2/", body, format="json")
    assert again.status_code == 200 and again.json()["epoch"] == 2
    assert AuditEvent.objects.filter(action="routing.configure").count() == 1


def test_patch_changes_weights_by_role_audits_before_and_after_and_is_idempotent(operator_api: APIClient) -> None:
    table, _, _ = routed_model(canary_bp=500)
    epoch = table.epoch
    response = operator_api.patch(
        "/api/v1/routing/tiny/", {"weights": {"canary": 2500, "stable": 7500}, "reason": "step 2"}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["epoch"] == epoch + 1
    event = AuditEvent.objects.filter(action="routing.set_weights").get()
    assert [p["weight_bp"] for p in event.before["pools"]] == [500, 9500]
    assert [p["weight_bp"] for p in event.after["pools"]] == [2500, 7500]
    assert (event.before["epoch"], event.after["epoch"], event.after["reason"]) == (epoch, epoch + 1, "step 2")
    same = operator_api.patch("/api/v1/routing/tiny/", {"weights": {"canary": 2500}}, format="json")
    assert same.json()["epoch"] == epoch + 1
    assert AuditEvent.objects.filter(action="routing.set_weights").count() == 1


@pytest.mark.parametrize(
    ("weights", "reason"),
    [
        ({"canary": 3000}, "weights must sum to 10000 basis points; canary 3000, stable 9000 sum to 12000."),
        ({"canary": 0, "stable": 9000}, "weights must sum to 10000 basis points; canary 0, stable 9000 sum to 9000."),
        ({"baseline": 100, "stable": 9900}, "`baseline` is neither a role nor a pool of the `tiny` table."),
    ],
)
def test_bad_weights_are_400_with_the_reason(operator_api: APIClient, weights: dict, reason: str) -> None:
    routed_model(canary_bp=1000)
    response = operator_api.patch("/api/v1/routing/tiny/", {"weights": weights}, format="json")
    assert response.status_code == 400
    assert response.json() == {"weights": [reason]}
    assert not AuditEvent.objects.filter(action="routing.set_weights").exists()
    assert RoutingTable.objects.get().weights() == {"canary": 1000, "stable": 9000}


@pytest.mark.parametrize(
    "body",
    [{"weights": {"canary": -1}}, {"weights": {"canary": 10001}}, {"weights": {}}, {"weights": {"canary": "lots"}}, {}],
)
def test_malformed_weights_are_400_naming_the_field(operator_api: APIClient, body: dict) -> None:
    routed_model()
    response = operator_api.patch("/api/v1/routing/tiny/", body, format="json")
    assert response.status_code == 400
    assert "weights" in response.json()


@pytest.mark.parametrize("flag", ["cordoned", "drain_requested", "unhealthy"])
def test_a_pool_given_weight_needs_a_ready_worker(operator_api: APIClient, flag: str) -> None:
    _, _, workers = routed_model(canary_bp=0)
    canary = workers["canary"][0]
    if flag == "unhealthy":
        Worker.objects.filter(pk=canary.pk).update(state=WorkerState.UNHEALTHY)
    else:
        Worker.objects.filter(pk=canary.pk).update(**{flag: True})
    response = operator_api.patch("/api/v1/routing/tiny/", {"weights": {"canary": 1000, "stable": 9000}}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "weights": ["pool `tiny-canary` has no ready worker (ready, not cordoned, not draining) to take its 1000 bp."]
    }


def test_taking_weight_off_a_pool_needs_no_ready_worker_and_an_abort_may_skip_the_check(operator: Any) -> None:
    table, _, workers = routed_model(canary_bp=2000)
    Worker.objects.filter(pool__name="tiny-canary").update(state=WorkerState.OFFLINE)
    Worker.objects.filter(pool__name="tiny-stable").update(state=WorkerState.UNHEALTHY)
    with pytest.raises(Exception, match="tiny-stable"):
        table.set_weights({"canary": 0, "stable": 10000}, actor=operator)
    epoch = table.set_weights({"canary": 0, "stable": 10000}, actor="rollout:1", reason="abort", require_ready=False)
    assert epoch == table.epoch and table.weights() == {"canary": 0, "stable": 10000}
    assert AuditEvent.objects.get(action="routing.set_weights").actor_repr == "rollout:1"


@pytest.mark.parametrize(
    ("pools", "field"),
    [
        ([{"pool": "nope", "role": "stable", "weight_bp": 10000}], "pools"),
        ([{"pool": "tiny-stable", "role": "leader", "weight_bp": 10000}], "pools"),
        (
            [
                {"pool": "tiny-stable", "role": "stable", "weight_bp": 5000},
                {"pool": "tiny-canary", "role": "stable", "weight_bp": 5000},
            ],
            "pools",
        ),
        (
            [
                {"pool": "tiny-stable", "role": "stable", "weight_bp": 5000},
                {"pool": "tiny-stable", "role": "canary", "weight_bp": 5000},
            ],
            "pools",
        ),
        ([{"pool": "tiny-stable", "role": "stable", "weight_bp": 9999}], "weights"),
    ],
)
def test_bad_tables_are_400_by_field(operator_api: APIClient, pools: list, field: str) -> None:
    routed_model()
    before = RoutingTable.objects.get().epoch
    response = operator_api.put("/api/v1/routing/tiny/", {"pools": pools}, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert RoutingTable.objects.get().epoch == before


def test_delete_removes_the_table_and_audits_it(operator_api: APIClient) -> None:
    routed_model()
    assert operator_api.delete("/api/v1/routing/tiny/").status_code == 204
    assert not RoutingTable.objects.exists()
    assert AuditEvent.objects.get(action="routing.delete").before["model"] == "tiny"
    assert operator_api.get("/api/v1/routing/tiny/").status_code == 404


def test_ack_query_parameters_are_checked(viewer_api: APIClient) -> None:
    routed_model()
    assert viewer_api.get("/api/v1/routing/tiny/acks/?epoch=zero").json() == {"epoch": ["must be a whole number."]}
    assert viewer_api.get("/api/v1/routing/tiny/acks/?wait=-1").status_code == 400
    status = viewer_api.get("/api/v1/routing/tiny/acks/").json()
    assert status["epoch"] == RoutingTable.objects.get().epoch


# ---- client keys --------------------------------------------------------------------
def test_an_output_cap_is_set_cleared_and_shown_per_route_bumping_the_epoch_and_audited(
    operator_api: APIClient,
) -> None:
    table, pools, _ = routed_model()
    assert operator_api.get("/api/v1/routing/tiny/").json()["max_output_tokens"] is None  # none by default
    epoch = table.epoch
    capped = operator_api.patch(
        "/api/v1/routing/tiny/", {"max_output_tokens": 512, "reason": "runaway chats"}, format="json"
    )
    assert capped.status_code == 200, capped.content
    assert capped.json()["max_output_tokens"] == 512 and capped.json()["epoch"] == epoch + 1
    event = AuditEvent.objects.get(action="routing.set_output_cap")
    assert (event.before["max_output_tokens"], event.after["max_output_tokens"]) == (None, 512)
    assert event.after["reason"] == "runaway chats"
    # The same cap again changes nothing; a PUT that leaves it out keeps it; null clears it.
    assert (
        operator_api.patch("/api/v1/routing/tiny/", {"max_output_tokens": 512}, format="json").json()["epoch"]
        == epoch + 1
    )
    body = {"pools": [pool_spec(pools["stable"], "stable", 10000), pool_spec(pools["canary"], "canary", 0)]}
    assert operator_api.put("/api/v1/routing/tiny/", body, format="json").json()["max_output_tokens"] == 512
    cleared = operator_api.put("/api/v1/routing/tiny/", {**body, "max_output_tokens": None}, format="json")
    assert cleared.status_code == 200 and cleared.json()["max_output_tokens"] is None
    assert [r["max_output_tokens"] for r in operator_api.get("/api/v1/routing/").json()] == [None]


@pytest.mark.parametrize("cap", [0, -1, 10**20, "many", 1.5, True])
def test_a_bad_output_cap_is_a_400_naming_the_field(operator_api: APIClient, admin_api: APIClient, cap: Any) -> None:
    routed_model()
    response = operator_api.patch("/api/v1/routing/tiny/", {"max_output_tokens": cap}, format="json")
    assert response.status_code == 400 and "max_output_tokens" in response.json(), response.content
    key = admin_api.post("/api/v1/client-keys/", {"name": "k", "max_output_tokens": cap}, format="json")
    assert key.status_code == 400 and "max_output_tokens" in key.json(), key.content
    assert RoutingTable.objects.get().max_output_tokens is None and not ClientKey.objects.exists()


def test_a_patch_with_nothing_to_change_is_a_400(operator_api: APIClient) -> None:
    routed_model()
    response = operator_api.patch("/api/v1/routing/tiny/", {"reason": "nothing"}, format="json")
    assert response.status_code == 400 and "weights" in response.json()


def test_a_client_key_carries_its_own_output_cap(admin_api: APIClient) -> None:
    response = admin_api.post("/api/v1/client-keys/", {"name": "batch jobs", "max_output_tokens": 256}, format="json")
    assert response.status_code == 201 and response.json()["max_output_tokens"] == 256
    key = ClientKey.objects.get()
    assert key.max_output_tokens == 256
    lifted = admin_api.patch(f"/api/v1/client-keys/{key.pk}/", {"max_output_tokens": None}, format="json")
    assert lifted.status_code == 200 and lifted.json()["max_output_tokens"] is None


def test_client_keys_are_admin_only_even_to_read(viewer_api: APIClient, operator_api: APIClient) -> None:
    assert viewer_api.get("/api/v1/client-keys/").status_code == 403
    assert operator_api.get("/api/v1/client-keys/").status_code == 403
    assert operator_api.post("/api/v1/client-keys/", {"name": "x"}, format="json").status_code == 403


def test_an_issued_key_is_shown_once_stored_hashed_and_audited(admin_api: APIClient, admin_user: Any) -> None:
    response = admin_api.post("/api/v1/client-keys/", {"name": "search frontend", "is_admin": False}, format="json")
    assert response.status_code == 201, response.content
    plaintext = response.json()["key"]
    assert plaintext.startswith("cpk_") and len(plaintext) > 40
    key = ClientKey.objects.get()
    assert key.key_hash == hash_secret(plaintext) and plaintext not in str(ClientKey.objects.values().get())
    assert admin_api.get(f"/api/v1/client-keys/{key.pk}/").json()["key"] is None
    event = AuditEvent.objects.get(action="clientkey.create")
    assert event.actor == admin_user and "key_hash" not in event.after
    revoked = admin_api.patch(f"/api/v1/client-keys/{key.pk}/", {"active": False}, format="json")
    assert revoked.status_code == 200 and revoked.json()["active"] is False
    assert AuditEvent.objects.get(action="clientkey.update").after["active"] is False
    assert admin_api.delete(f"/api/v1/client-keys/{key.pk}/").status_code == 204
    assert AuditEvent.objects.filter(action="clientkey.delete").exists()


def test_a_client_key_needs_a_name(admin_api: APIClient) -> None:
    response = admin_api.post("/api/v1/client-keys/", {}, format="json")
    assert response.status_code == 400 and "name" in response.json()


def test_the_openapi_document_has_the_routing_api() -> None:
    document = yaml.safe_load(APIClient().get("/api/schema/").content)
    for path in (
        "/api/v1/routing/",
        "/api/v1/routing/{model}/",
        "/api/v1/routing/{model}/acks/",
        "/api/v1/gateways/",
        "/api/v1/client-keys/",
    ):
        assert path in document["paths"], path
    assert {"get", "put", "patch", "delete"} <= set(document["paths"]["/api/v1/routing/{model}/"])


def test_the_demo_seed_routes_everything_to_stable_and_issues_one_fresh_key() -> None:
    from controlplane.gateway import demo

    make_pool("stable"), make_pool("canary"), make_pool("tiny")  # no workers yet: the demo seeds before they start
    tables = {"llama-sim": ("stable", "canary"), "tiny-model": ("tiny", None)}
    first = demo.seed(tables)
    second = demo.seed(tables)
    assert RoutingTable.objects.get(model="llama-sim").weights() == {"canary": 0, "stable": 10000}
    assert RoutingTable.objects.get(model="tiny-model").weights() == {"stable": 10000}
    assert ClientKey.objects.get().key_hash == hash_secret(second) != hash_secret(first)
    assert ClientKey.objects.get().is_admin


@pytest.fixture
def redis_down(settings: Any) -> None:
    """Redis is a port nobody listens on: every call fails to connect, as when
    the server is stopped (tests/faults/ stops a real one under load)."""
    from tests.support import free_port

    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"


def test_while_redis_is_down_tables_are_served_with_their_acks_unknown(viewer_api: APIClient, redis_down: None) -> None:
    routed_model(canary_bp=1000)
    one = viewer_api.get("/api/v1/routing/tiny/")
    assert one.status_code == 200, one.content
    assert one.json()["acks"] == {"epoch": one.json()["epoch"], "state": "unknown", "complete": False, "gateways": []}
    assert one.json()["pools"][0]["weight_bp"] == 1000
    listed = viewer_api.get("/api/v1/routing/")
    assert listed.status_code == 200 and listed.json()[0]["acks"]["state"] == "unknown"
    assert viewer_api.get("/api/v1/routing/tiny/acks/").json()["state"] == "unknown"


def test_what_needs_redis_answers_503_json_while_it_is_down(viewer_api: APIClient, redis_down: None) -> None:
    routed_model(canary_bp=1000)
    for path in ["/api/v1/gateways/", "/api/v1/routing/tiny/acks/?wait=1"]:
        response = viewer_api.get(path)
        assert response.status_code == 503, (path, response.content)
        assert response.json()["unavailable"] == "redis" and response["Retry-After"]


def test_acks_are_known_when_redis_is_up(viewer_api: APIClient) -> None:
    routed_model(canary_bp=1000)
    acks = viewer_api.get("/api/v1/routing/tiny/").json()["acks"]
    assert (acks["state"], acks["complete"]) == ("complete", True), (
        "no gateway is live here: nothing routes by old weights"
    )
