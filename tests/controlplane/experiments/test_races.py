""" "One experiment at a time on a worker" holds when the creates race:
identical POSTs sent at the same moment, each on its own connection, give
one experiment and a 400 naming the busy workers for every other."""

from __future__ import annotations

import threading
from typing import Any

from django.db import connection
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from controlplane.experiments.models import Experiment, Workload
from tests.controlplane.experiments.test_api import lab_workers
from tests.controlplane.factories import api_client, make_user

NUM_CLIENTS = 8


def test_identical_creates_sent_at_once_make_exactly_one_experiment(transactional_db: Any) -> None:
    workers = lab_workers(2)
    workload = Workload.from_scenario(name="race", scenario="long-tail", rate=2.0, duration_seconds=60)
    operator = make_user(Role.OPERATOR)
    body = {
        "name": "race",
        "workload": workload.pk,
        "workers": [w.name for w in workers],
        "duration_seconds": 5,
        "warmup_seconds": 1,
    }
    start = threading.Barrier(NUM_CLIENTS)
    replies: list[tuple[int, Any]] = []
    lock = threading.Lock()

    def create() -> None:
        client: APIClient = api_client(operator)
        try:
            start.wait(timeout=30)
            r = client.post("/api/v1/experiments/", body, format="json")
            with lock:
                replies.append((r.status_code, r.json()))
        finally:
            connection.close()

    threads = [threading.Thread(target=create) for _ in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    codes = sorted(code for code, _ in replies)
    assert codes == [201] + [400] * (NUM_CLIENTS - 1), replies
    assert Experiment.objects.filter(workers__in=workers).distinct().count() == 1
    for code, data in replies:
        if code == 400:
            assert "already uses some of these workers" in data["workers"][0], data
