from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane import audit
from controlplane.audit.models import AuditEvent
from tests.controlplane.factories import make_pool

pytestmark = pytest.mark.django_db


def test_record_names_a_user_actor_and_the_object(operator: Any) -> None:
    pool = make_pool("audited")
    event = audit.record(operator, "pool.rename", pool, {"name": "old"}, {"name": "audited"})
    event.refresh_from_db()
    assert (event.actor, event.actor_repr, event.action) == (operator, operator.username, "pool.rename")
    assert (event.object_type, event.object_id, event.object_repr) == ("fleet.pool", str(pool.pk), "audited")
    assert (event.before, event.after) == ({"name": "old"}, {"name": "audited"})


def test_record_takes_automatic_actors_and_hand_named_subjects() -> None:
    subject = audit.Subject("gateway.routing_table", 7, "routing epoch 7")
    event = audit.record("system:rollout", "routing.bump", subject, None, {"epoch": 7})
    assert (event.actor, event.actor_repr, event.object_type, event.object_id) == (
        None,
        "system:rollout",
        "gateway.routing_table",
        "7",
    )
    assert audit.record(None, "x.y", subject).actor_repr == "system"


def test_an_audit_row_survives_its_user(operator: Any) -> None:
    event = audit.record(operator, "pool.create", make_pool())
    operator.delete()
    event.refresh_from_db()
    assert event.actor is None and event.actor_repr.startswith("operator")


def test_audit_rows_cannot_be_rewritten(operator: Any) -> None:
    event = audit.record(operator, "pool.create", make_pool())
    event.action = "pool.nothing_happened"
    with pytest.raises(ValueError, match="immutable"):
        event.save()


def test_snapshot_leaves_out_secrets() -> None:
    from controlplane.fleet.models import EnrollmentToken

    token, _ = EnrollmentToken.issue("t")
    snap = audit.snapshot(token)
    assert "token_hash" not in snap and snap["name"] == "t"
    assert isinstance(snap["created"], str)


def test_the_api_lists_newest_first_and_filters(viewer_api: APIClient, operator: Any) -> None:
    pool = make_pool("filtered")
    audit.record(operator, "pool.create", pool, None, {"name": "filtered"})
    audit.record("system:health-sweep", "worker.state_change", audit.Subject("fleet.worker", 3, "w3"))
    body = viewer_api.get("/api/v1/audit/").json()
    assert [e["action"] for e in body["results"]] == ["worker.state_change", "pool.create"]
    assert body["results"][1]["actor"] == operator.username
    assert [e["action"] for e in viewer_api.get("/api/v1/audit/?action_prefix=pool.").json()["results"]] == [
        "pool.create"
    ]
    assert viewer_api.get("/api/v1/audit/?actor=system:health-sweep").json()["count"] == 1
    assert viewer_api.get(f"/api/v1/audit/?object_type=fleet.pool&object_id={pool.pk}").json()["count"] == 1
    since = (timezone.now() + timedelta(minutes=1)).isoformat()
    assert viewer_api.get("/api/v1/audit/", {"since": since}).json()["count"] == 0


def test_a_bad_since_is_a_field_error(viewer_api: APIClient) -> None:
    response = viewer_api.get("/api/v1/audit/?since=last-tuesday")
    assert response.status_code == 400 and "since" in response.json()


def test_the_audit_log_is_read_only_over_the_api(admin_api: APIClient) -> None:
    event = audit.record(None, "x.y", audit.Subject("a.b", 1, "c"))
    assert admin_api.post("/api/v1/audit/", {}, format="json").status_code == 405
    assert admin_api.delete(f"/api/v1/audit/{event.pk}/").status_code == 405
    assert AuditEvent.objects.filter(pk=event.pk).exists()
