""" "One unfinished rollout per routing table" holds when the creates race:
identical POSTs sent at the same moment, each on its own connection, give
one rollout and a 400 naming the conflict for every other."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import ProtectedError
from rest_framework.test import APIClient

from controlplane.accounts.errors import exception_handler
from controlplane.accounts.roles import Role
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout
from tests.controlplane.factories import api_client, make_user
from tests.controlplane.rollouts.factories import make_fleet

NUM_CLIENTS = 8


def test_identical_creates_sent_at_once_make_exactly_one_rollout(transactional_db: Any) -> None:
    fleet = make_fleet(num_stable=2, num_canary=1)
    operator = make_user(Role.OPERATOR)
    body = {
        "model": fleet.table.model,
        "stable_pool": fleet.stable.name,
        "canary_pool": fleet.canary.name,
        "target_revision": fleet.target_revision.pk,
    }
    start = threading.Barrier(NUM_CLIENTS)
    replies: list[tuple[int, Any]] = []
    lock = threading.Lock()

    def create() -> None:
        client: APIClient = api_client(operator)
        try:
            start.wait(timeout=30)
            r = client.post("/api/v1/rollouts/", body, format="json")
            with lock:
                replies.append((r.status_code, r.json()))
        finally:
            connection.close()

    threads = [threading.Thread(target=create) for _ in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    codes = sorted(code for code, _ in replies)
    assert codes == [201] + [400] * (NUM_CLIENTS - 1), replies
    assert Rollout.objects.filter(routing_table=fleet.table).count() == 1
    for code, data in replies:
        if code == 400:
            assert "non_field_errors" in data, data


def test_the_database_refuses_a_second_unfinished_rollout_on_a_table(db: Any) -> None:
    fleet = make_fleet(num_stable=2, num_canary=1)
    first = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
    )
    fields = {
        f.name: getattr(first, f.name) for f in Rollout._meta.concrete_fields if f.name not in ("id", "schedule_token")
    }
    with pytest.raises(IntegrityError), transaction.atomic():
        Rollout.objects.create(**fields)
    Rollout.objects.filter(pk=first.pk).update(phase=Phase.ABORTED.value)
    Rollout.objects.create(**fields)  # a finished one no longer holds the table


def test_a_delete_waits_for_a_reconcile_holding_the_rollout_and_then_refuses_what_it_restarted(
    transactional_db: Any,
) -> None:
    """DELETE right after a retry: the reconcile holds the row, adds an event
    and moves the rollout on. The delete used to collect the events before
    the reconcile's landed and fail on the foreign key (a 500)."""
    fleet = make_fleet(num_stable=2, num_canary=1)
    operator = make_user(Role.OPERATOR)
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
    )
    Rollout.objects.filter(pk=rollout.pk).update(phase=Phase.ABORTED.value)
    holding, reply = threading.Event(), []

    def reconcile() -> None:
        try:
            with transaction.atomic():
                held = Rollout.objects.select_for_update().get(pk=rollout.pk)
                holding.set()
                time.sleep(1.0)  # the DELETE arrives while the row is held
                held.record("retried", "retry by the reconciler")
                Rollout.objects.filter(pk=rollout.pk).update(phase=Phase.PROGRESSING.value)
        finally:
            connection.close()

    def delete() -> None:
        try:
            r = api_client(operator).delete(f"/api/v1/rollouts/{rollout.pk}/")
            reply.append((r.status_code, r.json() if r.content else None))
        finally:
            connection.close()

    a = threading.Thread(target=reconcile)
    a.start()
    assert holding.wait(10)
    b = threading.Thread(target=delete)
    b.start()
    a.join(30)
    b.join(30)
    assert reply == [(400, {"non_field_errors": ["abort the rollout before deleting it."]})]
    assert Rollout.objects.filter(pk=rollout.pk).exists()


def test_a_409_names_a_holder_whose_row_went_away_by_its_pk(db: Any) -> None:
    fleet = make_fleet(num_stable=2, num_canary=1)
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
    )
    stale = Rollout.objects.only("id").get(pk=rollout.pk)  # its __str__ reads deferred fields
    Rollout.objects.filter(pk=rollout.pk).delete()
    reply = exception_handler(ProtectedError("held", {stale}), {})
    assert reply is not None and reply.status_code == 409
    assert reply.data["in_use_by"] == [f"rollout {rollout.pk}"]
