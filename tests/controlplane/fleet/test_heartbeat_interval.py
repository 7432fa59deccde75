"""Heartbeat intervals that grow with the fleet: the rule as a table, the
interval the agent endpoints hand out as the live fleet grows, and the health
sweep judging each worker by the interval it was told."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import time_machine
from rest_framework.test import APIClient

from controlplane import outages
from controlplane.fleet.health import Thresholds, WorkerState, fleet_heartbeat_interval
from controlplane.fleet.heartbeat import fleet_count
from controlplane.fleet.models import EnrollmentToken, Worker
from tests.controlplane.factories import heartbeat_request, register_request
from workers import contract

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def fresh_counts() -> Iterator[None]:
    outages.forget()
    fleet_count.forget()
    yield
    fleet_count.forget()  # no other test may see this one's fleet size
    outages.forget()


@pytest.fixture
def scaling(settings) -> None:  # type: ignore[no-untyped-def]
    """10 heartbeats a second at most; 2 s for a small fleet, 15 s at most;
    unhealthy after 10 s (five missed beats) at the base interval."""
    settings.HEARTBEAT_TARGET_RATE = 10.0
    settings.HEARTBEAT_INTERVAL_SECONDS = 2.0
    settings.HEARTBEAT_INTERVAL_MAX_SECONDS = 15.0
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10.0
    settings.WORKER_OFFLINE_AFTER_SECONDS = 60.0


@pytest.mark.parametrize(
    ("num_workers", "expected_seconds"),
    [
        (0, 2.0),
        (1, 2.0),
        (200, 2.0),  # 200 workers every 2 s: exactly the target of 100/s
        (201, 3.0),  # past it: whole seconds, rounded up
        (450, 5.0),
        (1000, 10.0),
        (1001, 11.0),
        (1500, 15.0),
        (100_000, 15.0),  # the ceiling holds; the rate passes the target
    ],
)
def test_the_interval_grows_with_the_live_worker_count(num_workers: int, expected_seconds: float) -> None:
    interval = fleet_heartbeat_interval(num_workers, target_rate=100.0, floor_seconds=2.0, ceiling_seconds=15.0)
    assert interval == expected_seconds
    if interval < 15.0:
        assert num_workers / interval <= 100.0, "the fleet's heartbeats stay within the target rate"


def test_no_target_rate_or_a_ceiling_below_the_floor_keeps_the_floor() -> None:
    assert fleet_heartbeat_interval(10_000, target_rate=0.0, floor_seconds=2.0, ceiling_seconds=15.0) == 2.0
    assert fleet_heartbeat_interval(10_000, target_rate=1.0, floor_seconds=2.0, ceiling_seconds=1.0) == 2.0


@pytest.mark.parametrize(
    ("told_seconds", "unhealthy_after", "offline_after", "interval"),
    [
        (None, 10.0, 60.0, 2.0),  # told nothing yet: the base limits
        (1.0, 10.0, 60.0, 2.0),  # never shorter than the base
        (2.0, 10.0, 60.0, 2.0),
        (10.0, 50.0, 300.0, 10.0),  # five missed beats, as at the base interval
        (15.0, 75.0, 450.0, 15.0),
    ],
)
def test_the_limits_scale_with_the_interval_told(
    told_seconds: float | None, unhealthy_after: float, offline_after: float, interval: float
) -> None:
    base = Thresholds(10.0, 60.0, heartbeat_interval_seconds=2.0, outage_grace_seconds=32.0)
    scaled = base.for_interval(told_seconds)
    assert (scaled.unhealthy_after_seconds, scaled.offline_after_seconds) == (unhealthy_after, offline_after)
    assert scaled.heartbeat_interval_seconds == interval and scaled.outage_grace_seconds == 32.0


def _fleet(num_workers: int, state: WorkerState = WorkerState.READY, prefix: str = "w") -> None:
    Worker.objects.bulk_create(
        Worker(name=f"{prefix}-{i}", url=f"http://10.0.0.1:{8000 + i}", state=state) for i in range(num_workers)
    )


def _enroll(name: str) -> tuple[dict, str]:
    _, token = EnrollmentToken.issue(name)
    response = APIClient().post(contract.REGISTER_PATH, register_request(token, name), format="json")
    assert response.status_code == 201, response.content
    reply = response.json()
    return reply, reply["secret"]


def _beat(secret: str) -> dict:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = client.post(contract.HEARTBEAT_PATH, heartbeat_request(), format="json")
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.django_db
@pytest.mark.usefixtures("scaling")
def test_the_agent_endpoints_hand_out_a_longer_interval_as_the_live_fleet_grows() -> None:
    reply, secret = _enroll("small")
    assert reply["heartbeat_interval_seconds"] == 2.0
    assert _beat(secret)["heartbeat_interval_seconds"] == 2.0

    _fleet(99)  # 100 live workers at 10/s: every 10 s
    _fleet(500, WorkerState.OFFLINE, prefix="gone")  # the offline send nothing and are not counted
    fleet_count.forget()
    assert _beat(secret)["heartbeat_interval_seconds"] == 10.0
    assert Worker.objects.get(name="small").heartbeat_interval_seconds == 10.0, "the row records what it was told"

    fleet_count.forget()
    reply, _ = _enroll("newcomer")
    assert reply["heartbeat_interval_seconds"] == 10.0
    assert Worker.objects.get(name="newcomer").heartbeat_interval_seconds == reply["heartbeat_interval_seconds"]


@pytest.mark.django_db
@pytest.mark.usefixtures("scaling")
def test_the_sweep_spares_a_worker_keeping_its_longer_interval_and_marks_it_once_it_misses_it() -> None:
    with time_machine.travel(T0, tick=False) as clock:
        _, quick = _enroll("told-2s")
        assert _beat(quick)["heartbeat_interval_seconds"] == 2.0  # alone in the fleet
        _fleet(98)  # never heartbeat: marked at the base limit, but still counted until offline
        _, slow = _enroll("told-10s")
        fleet_count.forget()
        assert _beat(slow)["heartbeat_interval_seconds"] == 10.0  # 100 workers at 10/s
        slow_id, quick_id = Worker.objects.get(name="told-10s").pk, Worker.objects.get(name="told-2s").pk

        # One minute of the slow worker beating every 10 s, swept every 5 s:
        # silent 10 s at a time, the base limit, and never marked. The quick
        # one, told 2 s, falls silent and is marked at the base limit.
        marked: dict[int, int] = {}
        for beat in range(6):
            for half in range(2):
                clock.shift(5)
                for pk, _, to in Worker.sweep_liveness():
                    if to == WorkerState.UNHEALTHY:
                        marked[pk] = 10 * beat + 5 * (half + 1)
            assert _beat(slow)["heartbeat_interval_seconds"] == 10.0
        assert slow_id not in marked and Worker.objects.get(pk=slow_id).state == WorkerState.READY
        assert marked[quick_id] == 10, "the worker told 2 s is held to the base limit"

        # The slow one stops: marked once it has missed five of its beats (50 s), not before.
        clock.shift(49)
        assert slow_id not in [pk for pk, _, _ in Worker.sweep_liveness()]
        clock.shift(2)
        assert (slow_id, WorkerState.READY, WorkerState.UNHEALTHY) in Worker.sweep_liveness()
        clock.shift(300)
        assert (slow_id, WorkerState.UNHEALTHY, WorkerState.OFFLINE) in Worker.sweep_liveness()
