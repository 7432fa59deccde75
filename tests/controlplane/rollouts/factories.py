"""Rows and stand-ins the rollout tests share, made the way the product
makes them: profiles through add_revision, workers by enrolling and
heartbeating, routing tables through configure()."""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway import bus
from controlplane.gateway.models import PoolSpec, RoutingTable
from controlplane.profiles.models import Profile, ProfileRevision
from tests.controlplane.factories import enroll_worker, heartbeat_request
from workers import contract


@dataclass
class Fleet:
    table: RoutingTable
    stable: Pool
    canary: Pool
    baseline: Pool | None
    stable_revision: ProfileRevision
    target_revision: ProfileRevision
    workers: dict[str, list[Worker]] = field(default_factory=dict)

    def all_workers(self) -> list[Worker]:
        return [w for ws in self.workers.values() for w in ws]


def revisions(prefix: str = "p") -> tuple[ProfileRevision, ProfileRevision]:
    """A monolithic stable revision and a chunked target of it."""
    profile = Profile.objects.create(name=f"{prefix}-{uuid.uuid4().hex[:6]}")
    stable = profile.add_revision({"prefill_mode": "monolithic", "max_num_batched_tokens": 512}, comment="stable")
    target = profile.add_revision(
        {"prefill_mode": "chunked", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64},
        comment="chunked",
    )
    return stable, target


def make_fleet(
    model: str = "tiny",
    *,
    num_stable: int = 2,
    num_canary: int = 1,
    num_baseline: int = 0,
    urls: dict[str, list[str]] | None = None,
    max_model_len: int = 512,
) -> Fleet:
    """A routing table with a stable pool (all traffic), a canary pool and
    optionally a baseline pool (weight 0), every worker ready on the stable
    revision."""
    stable_rev, target_rev = revisions(model.replace("/", "-"))
    tag = uuid.uuid4().hex[:4]
    counts = {"stable": num_stable, "canary": num_canary, "baseline": num_baseline}
    pools: dict[str, Pool] = {}
    workers: dict[str, list[Worker]] = {}
    for role, n in counts.items():
        if not n and role == "baseline":
            continue
        pool = Pool.objects.create(name=f"{model}-{role}-{tag}".replace("/", "-"))
        pool.set_desired_revision(stable_rev)
        pools[role] = pool
        role_urls = (urls or {}).get(role) or [f"http://127.0.0.1:9/{role}{i}" for i in range(n)]
        workers[role] = []
        for i, url in enumerate(role_urls):
            worker, _ = enroll_worker(f"{pool.name}-{i}", pool=pool, url=url, max_model_len=max_model_len)
            heartbeat(worker, "ready", stable_rev.pk)
            workers[role].append(worker)
    table = RoutingTable.create_audited(model, actor="test")
    specs = [PoolSpec(pools["stable"], "stable", 10000), PoolSpec(pools["canary"], "canary", 0)]
    if "baseline" in pools:
        specs.append(PoolSpec(pools["baseline"], "baseline", 0))
    table.configure(specs, actor="test")
    return Fleet(table, pools["stable"], pools["canary"], pools.get("baseline"), stable_rev, target_rev, workers)


def heartbeat(worker: Worker, state: str, running_revision_id: int | None) -> None:
    worker = Worker.objects.for_heartbeat().get(pk=worker.pk)
    worker.record_heartbeat(contract.parse_heartbeat(heartbeat_request(state, running_revision_id)))


def follow(fleet: Fleet | None = None, *, only: list[Worker] | None = None, beat_all: bool = False) -> int:
    """Every worker does what its agent would: run its desired revision and
    report ready (``beat_all``: every worker heartbeats, switched or not, as
    live agents do). Returns how many switched."""
    switched = 0
    targets = only if only is not None else (fleet.all_workers() if fleet else list(Worker.objects.all()))
    for w in targets:
        worker = Worker.objects.for_heartbeat().get(pk=w.pk)
        desired = worker.effective_desired_revision_id()
        changed = worker.running_revision_id != desired or worker.state != WorkerState.READY
        if changed or beat_all:
            heartbeat(worker, "ready", desired)
        switched += changed
    return switched


class FakeGateway:
    """A gateway's liveness record and acks in Redis, written by the test:
    the stand-in for a gateway whose acks the test times itself."""

    def __init__(self, ttl_seconds: float = 30.0):
        self.id = f"{socket.gethostname()}-fake-{uuid.uuid4().hex[:6]}"
        self.ttl_ms = int(ttl_seconds * 1000)
        self.acks: dict[str, int] = {}
        self.refresh()

    def refresh(self, *, publish: bool = False) -> None:
        conn = bus.client()
        info = json.dumps({"address": "fake", "hostname": socket.gethostname(), "pid": 0, "started_at": time.time()})
        pipe = conn.pipeline(transaction=True)
        pipe.hset(
            bus.gateway_key(self.id),
            mapping={"info": info, "acks": json.dumps(self.acks), "last_seen": repr(time.time())},
        )
        pipe.pexpire(bus.gateway_key(self.id), self.ttl_ms)
        pipe.zadd(bus.live_key(), {self.id: time.time()})
        if publish:
            pipe.publish(bus.acks_channel(), self.id)
        pipe.execute()

    def ack(self, table: RoutingTable) -> int:
        table.refresh_from_db(fields=["epoch"])
        self.acks[str(table.pk)] = table.epoch
        self.refresh(publish=True)
        return table.epoch

    def withdraw(self) -> None:
        bus.forget_gateway(self.id)


def table_weights(table: RoutingTable) -> dict[str, int]:
    table.refresh_from_db()
    return table.weights()


def kinds(rollout: Any) -> list[str]:
    return list(rollout.events.order_by("time", "id").values_list("kind", flat=True))


class Agents:
    """A thread that plays every worker's agent: each follows its desired
    revision (``follow``) every ``interval`` seconds, until stopped."""

    def __init__(self, fleet: Fleet, interval: float = 0.2):
        import threading

        self.fleet, self.interval = fleet, interval
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agents", daemon=True)

    def __enter__(self) -> Agents:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from django.db import connection

        try:
            while not self._stop.wait(self.interval):
                if not self.paused.is_set():
                    follow(self.fleet, beat_all=True)
        finally:
            connection.close()
