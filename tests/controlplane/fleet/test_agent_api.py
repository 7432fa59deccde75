"""The control plane's side of workers/contract.py, over HTTP."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import EnrollmentToken, Worker
from tests.controlplane.factories import (
    enroll_worker,
    heartbeat_request,
    make_pool,
    make_profile,
    make_user,
    register_request,
)
from workers import contract

pytestmark = pytest.mark.django_db
REGISTER, HEARTBEAT = contract.REGISTER_PATH, contract.HEARTBEAT_PATH


def agent(secret: str | None = None) -> APIClient:
    client = APIClient()
    if secret:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_register_exchanges_the_token_for_a_secret_and_joins_the_tokens_pool() -> None:
    pool = make_pool("gpu-a")
    token, plaintext = EnrollmentToken.issue("rack", pool=pool)
    response = agent().post(REGISTER, register_request(plaintext, "w1"), format="json")
    assert response.status_code == 201, response.content
    reply = response.json()
    assert set(reply) == set(contract.RegisterReply.__annotations__)
    worker = Worker.objects.get(pk=reply["worker_id"])
    assert (worker.name, worker.pool, worker.state_label) == ("w1", pool, "registering")
    assert worker.labels == {"zone": "a"} and worker.max_model_len == 512
    assert reply["secret"] not in str(Worker.objects.filter(pk=worker.pk).values().first())
    token.refresh_from_db()
    assert token.num_uses == 1
    event = AuditEvent.objects.get(action="worker.register")
    assert event.actor_repr == "worker:w1" and "secret_hash" not in event.after


@pytest.mark.parametrize("case", ["unknown", "expired", "used_up"])
def test_register_with_a_bad_enrollment_token_is_401(case: str) -> None:
    if case == "unknown":
        plaintext = "cpe_nope"
    elif case == "expired":
        _, plaintext = EnrollmentToken.issue("old", expires_at=timezone.now() - timedelta(seconds=1))
    else:
        _, plaintext = EnrollmentToken.issue("once", max_uses=1)
        assert agent().post(REGISTER, register_request(plaintext, "first"), format="json").status_code == 201
    response = agent().post(REGISTER, register_request(plaintext, "w2"), format="json")
    assert response.status_code == 401
    assert not Worker.objects.filter(name="w2").exists()


@pytest.mark.parametrize(
    ("override", "bad_field"),
    [
        ({"engine_kind": "tpu"}, "engine_kind"),
        ({"url": "ftp://x"}, "url"),
        ({"name": "  "}, "name"),
        ({"contract_version": 99}, "contract_version"),
        ({"max_model_len": "long"}, "max_model_len"),
        ({"labels": ["a"]}, "labels"),
    ],
)
def test_register_with_a_body_that_breaks_the_contract_is_400_by_field(override: dict, bad_field: str) -> None:
    _, plaintext = EnrollmentToken.issue("t")
    body = {**register_request(plaintext, "w3"), **override}
    response = agent().post(REGISTER, body, format="json")
    assert response.status_code == 400
    assert bad_field in response.json()


def test_a_restarted_worker_keeps_its_row_and_gets_a_new_secret() -> None:
    worker, old_secret = enroll_worker("restarts")
    worker.set_flags(cordoned=True)
    _, plaintext = EnrollmentToken.issue("again")
    reply = agent().post(REGISTER, register_request(plaintext, "restarts"), format="json").json()
    assert reply["worker_id"] == worker.pk
    assert agent(old_secret).post(HEARTBEAT, heartbeat_request(), format="json").status_code == 401
    assert agent(reply["secret"]).post(HEARTBEAT, heartbeat_request(), format="json").status_code == 200
    worker.refresh_from_db()
    assert worker.cordoned, "an operator's cordon survives a restart"


@pytest.mark.parametrize("header", [None, "Bearer cpw_wrong", "Bearer", "Token abc"])
def test_heartbeat_without_a_valid_secret_is_401(header: str | None) -> None:
    enroll_worker()
    client = APIClient()
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    response = client.post(HEARTBEAT, heartbeat_request(), format="json")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    ("body", "bad_field"),
    [
        ({"state": "dancing"}, "state"),
        ({"running_revision_id": "one"}, "running_revision_id"),
        ({"load": 3}, "load"),
    ],
)
def test_heartbeat_with_a_body_that_breaks_the_contract_is_400_by_field(body: dict, bad_field: str) -> None:
    _, secret = enroll_worker()
    response = agent(secret).post(HEARTBEAT, heartbeat_request(**body), format="json")
    assert response.status_code == 400
    assert bad_field in response.json()


def test_heartbeat_reply_carries_the_desired_revision_in_full() -> None:
    revision = make_profile("wanted", max_num_batched_tokens=1024)
    worker, secret = enroll_worker(pool=make_pool(revision=revision))
    reply = agent(secret).post(HEARTBEAT, heartbeat_request(state="loading"), format="json").json()
    assert reply == {
        "worker_id": worker.pk,
        "desired": {"revision_id": revision.pk, "name": "wanted", "revision": 1, "fields": revision.fields},
        "drain": False,
        "heartbeat_interval_seconds": 2.0,
    }
    worker.refresh_from_db()
    assert worker.state_label == "applying"
    assert worker.load["num_requests_running"] == 1


def test_heartbeat_on_the_desired_revision_ends_drift_and_records_the_apply() -> None:
    revision = make_profile()
    worker, secret = enroll_worker(pool=make_pool(revision=revision))
    assert worker.drift_since is not None
    agent(secret).post(HEARTBEAT, heartbeat_request(running_revision_id=revision.pk), format="json")
    worker.refresh_from_db()
    assert (worker.state_label, worker.running_revision, worker.drift_since) == ("ready", revision, None)
    assert AuditEvent.objects.filter(action="worker.profile_applied", object_id=str(worker.pk)).count() == 1
    agent(secret).post(HEARTBEAT, heartbeat_request(running_revision_id=revision.pk), format="json")
    assert AuditEvent.objects.filter(action="worker.profile_applied").count() == 1, "only changes are audited"


def test_heartbeat_naming_an_unknown_revision_counts_as_running_none() -> None:
    worker, secret = enroll_worker()
    response = agent(secret).post(HEARTBEAT, heartbeat_request(running_revision_id=987654), format="json")
    assert response.status_code == 200
    worker.refresh_from_db()
    assert worker.running_revision is None


def test_drain_requested_reaches_the_agent_in_the_reply() -> None:
    worker, secret = enroll_worker()
    worker.set_flags(drain_requested=True)
    assert agent(secret).post(HEARTBEAT, heartbeat_request(), format="json").json()["drain"] is True


def test_a_heartbeat_brings_an_unhealthy_worker_back_and_says_so_in_the_audit() -> None:
    worker, secret = enroll_worker()
    agent(secret).post(HEARTBEAT, heartbeat_request(), format="json")
    with time_machine.travel(timezone.now() + timedelta(seconds=30)):
        Worker.sweep_liveness()
        worker.refresh_from_db()
        assert worker.state_label == "unhealthy"
        agent(secret).post(HEARTBEAT, heartbeat_request(), format="json")
    worker.refresh_from_db()
    assert worker.state_label == "ready"
    back = AuditEvent.objects.filter(action="worker.state_change", actor_repr="worker:" + worker.name).get()
    assert (back.before, back.after) == ({"state": "unhealthy"}, {"state": "ready"})


def test_an_agent_reporting_its_engine_unhealthy_is_stored_with_the_reason_and_audited_once() -> None:
    worker, secret = enroll_worker()
    agent(secret).post(HEARTBEAT, heartbeat_request(), format="json")
    reason = "the engine's step thread is not running."
    for _ in range(2):
        response = agent(secret).post(
            HEARTBEAT, heartbeat_request(state="unhealthy", health_error=reason), format="json"
        )
        assert response.status_code == 200
    worker.refresh_from_db()
    assert (worker.state_label, worker.health_error) == ("unhealthy", reason)
    assert worker not in Worker.objects.routable()
    changes = AuditEvent.objects.filter(action="worker.state_change", actor_repr="worker:" + worker.name)
    assert [(e.before, e.after) for e in changes] == [({"state": "ready"}, {"state": "unhealthy", "reason": reason})]

    staff = APIClient()
    staff.force_authenticate(make_user(Role.VIEWER))
    assert staff.get(f"/api/v1/workers/{worker.pk}/").json()["health_error"] == reason

    agent(secret).post(HEARTBEAT, heartbeat_request(), format="json")  # a new engine serves again
    worker.refresh_from_db()
    assert (worker.state_label, worker.health_error) == ("ready", "")


def test_a_heartbeat_carrying_a_new_url_moves_the_worker_there() -> None:
    worker, secret = enroll_worker()
    old = worker.url
    agent(secret).post(HEARTBEAT, heartbeat_request(url="http://127.0.0.1:18123/"), format="json")
    worker.refresh_from_db()
    assert worker.url == "http://127.0.0.1:18123" != old
    moved = AuditEvent.objects.get(action="worker.url_change")
    assert (moved.before, moved.after) == ({"url": old}, {"url": "http://127.0.0.1:18123"})
    agent(secret).post(HEARTBEAT, heartbeat_request(url="http://127.0.0.1:18123"), format="json")
    assert AuditEvent.objects.filter(action="worker.url_change").count() == 1, "only changes are audited"


@pytest.mark.parametrize("url", ["ftp://example.com", "http://" + "x" * 400, 5])
def test_a_heartbeat_with_a_bad_url_is_400_naming_it(url: object) -> None:
    _, secret = enroll_worker()
    response = agent(secret).post(HEARTBEAT, heartbeat_request(url=url), format="json")
    assert response.status_code == 400 and "url" in response.json()
