"""What a gateway loads (``load_state``) and how it stays current
(``Refresher``), on the test PostgreSQL and Redis, without a gateway process."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from controlplane import live
from controlplane.accounts.secrets import hash_secret
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from controlplane.gateway import bus
from controlplane.gateway.models import ClientKey
from controlplane.gateway.presence import Presence
from controlplane.gateway.refresher import Refresher, load_state
from controlplane.gateway.state import GatewayState, StateHolder
from tests.controlplane.factories import enroll_worker, heartbeat_request
from tests.controlplane.gateway.factories import routed_model
from tests.support import wait_until


# ---- which workers a gateway may route to --------------------------------------------------
def _ready_then_silent(worker: Worker) -> None:
    """Heartbeats stop; the health sweep marks it unhealthy."""
    long_ago = timezone.now() - timedelta(seconds=30)
    worker.record_heartbeat(heartbeat_request("ready"), now=long_ago)
    Worker.sweep_liveness()


def _drain_requested_only(worker: Worker) -> None:
    """The flag alone (set_flags also cordons): the gateway must heed drain
    on its own, not only by way of the cordon."""
    worker.record_heartbeat(heartbeat_request("ready"))
    Worker.objects.filter(pk=worker.pk).update(drain_requested=True)


SETUPS: dict[str, Callable[[Worker], None]] = {
    "ready": lambda w: w.record_heartbeat(heartbeat_request("ready")),
    "reports draining": lambda w: w.record_heartbeat(heartbeat_request("draining")),
    "reports applying": lambda w: w.record_heartbeat(heartbeat_request("applying")),
    "unhealthy": _ready_then_silent,
    "registering": lambda w: None,
    "drain requested": lambda w: (w.record_heartbeat(heartbeat_request("ready")), w.set_flags(drain_requested=True)),
    "drain requested only": _drain_requested_only,
    "cordoned": lambda w: (w.record_heartbeat(heartbeat_request("ready")), w.set_flags(cordoned=True)),
}
EXPECTED_STATES = {
    "reports draining": WorkerState.DRAINING,
    "unhealthy": WorkerState.UNHEALTHY,
    "reports applying": WorkerState.APPLYING,
}


@pytest.mark.parametrize("case", list(SETUPS))
def test_the_snapshot_holds_only_ready_workers_neither_draining_nor_unhealthy_nor_cordoned(
    case: str, transactional_db: Any
) -> None:
    _, pools, workers = routed_model()
    worker, _ = enroll_worker(f"w-{case.replace(' ', '-')}", pool=pools["stable"], url="http://127.0.0.1:9/x")
    SETUPS[case](worker)
    worker.refresh_from_db()
    if case in EXPECTED_STATES:
        assert worker.state == EXPECTED_STATES[case]
    stable = load_state().tables["tiny"].pools[pools["stable"].pk]
    expected = [workers["stable"][0].pk] + ([worker.pk] if case == "ready" else [])
    assert [w.id for w in stable.workers] == expected


# ---- staying current ----------------------------------------------------------------------
def _load_and_let_go() -> GatewayState:
    """The real load, giving its connection back: the refresher's thread
    outlives the test database otherwise."""
    try:
        return load_state()
    finally:
        connections.close_all()


@contextlib.contextmanager
def refresher(*, poll_seconds: float, notices_redis_url: str) -> Iterator[Refresher]:
    """A Refresher on its own event loop thread, as ``rungateway`` runs one;
    the test reads its holder from outside, as requests do."""
    from django.conf import settings

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-gateway-loop", daemon=True)
    thread.start()

    async def make() -> Refresher:
        presence = Presence(settings.REDIS_URL, address="127.0.0.1:0", ttl_seconds=5)
        r = Refresher(
            StateHolder(),
            presence,
            load=_load_and_let_go,
            poll_seconds=poll_seconds,
            heartbeat_seconds=1.0,
            redis_url=notices_redis_url,
        )
        await r.start()
        return r

    r = asyncio.run_coroutine_threadsafe(make(), loop).result(timeout=30)
    try:
        yield r
    finally:
        asyncio.run_coroutine_threadsafe(r.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _canary_bp(r: Refresher) -> int:
    table = r.holder.current.tables["tiny"]
    return next(p.weight_bp for p in table.pools.values() if p.role.value == "canary")


def test_a_notice_applies_a_change_without_waiting_for_the_poll(transactional_db: Any) -> None:
    from django.conf import settings

    table, _, _ = routed_model(canary_bp=0)
    with refresher(poll_seconds=3600, notices_redis_url=settings.REDIS_URL) as r:
        assert _canary_bp(r) == 0
        # Subscribed (so the notice cannot be lost), and every load so far done.
        wait_until(lambda: dict(bus.client().pubsub_numsub(bus.notices_channel())).get(bus.notices_channel().encode()))
        wait_until(lambda: r.num_loads >= 2)
        loads = r.num_loads
        epoch = table.set_weights({"canary": 2500, "stable": 7500}, actor="test")
        # A weight notice carries the table: applied from the notice itself.
        wait_until(lambda: r.holder.current.tables["tiny"].epoch == epoch)
        assert _canary_bp(r) == 2500
        # A key notice carries nothing: it wakes a reload, well before the poll.
        _, plaintext = ClientKey.issue("new")
        wait_until(lambda: hash_secret(plaintext) in r.holder.current.keys)
        assert r.num_loads > loads


def test_polling_applies_a_change_when_no_notice_arrives(transactional_db: Any) -> None:
    table, _, _ = routed_model(canary_bp=0)
    # Notices come from a Redis nobody answers on: the poll is the only way.
    with refresher(poll_seconds=0.3, notices_redis_url="redis://127.0.0.1:1/0") as r:
        assert _canary_bp(r) == 0
        epoch = table.set_weights({"canary": 2500, "stable": 7500}, actor="test")
        wait_until(lambda: r.holder.current.tables["tiny"].epoch == epoch)
        assert _canary_bp(r) == 2500
        _, plaintext = ClientKey.issue("new")
        wait_until(lambda: hash_secret(plaintext) in r.holder.current.keys)


def _group_members(group: str) -> int:
    """How many channels joined a channel-layer group (channels_redis keeps
    each group as a sorted set under ``<prefix>:group:<name>``)."""
    from django.conf import settings

    prefix = settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"]
    return int(bus.client().zcard(f"{prefix}:group:{group}"))


def test_a_worker_change_reaches_the_gateway_as_the_fleets_domain_event(transactional_db: Any) -> None:
    """Not a UI group: the gateway listens to ``fleet.worker_changed``."""
    _, pools, workers = routed_model()
    stable = workers["stable"][0]
    group = live.group(live.Event.WORKER_CHANGED)
    members = _group_members(group)
    # Notices from a Redis nobody answers on and an hour's poll: only the event can wake a reload.
    with refresher(poll_seconds=3600, notices_redis_url="redis://127.0.0.1:1/0") as r:
        wait_until(lambda: _group_members(group) > members)
        pool = pools["stable"].pk
        assert [w.id for w in r.holder.current.tables["tiny"].pools[pool].workers] == [stable.pk]
        stable.set_flags(cordoned=True)
        wait_until(lambda: not r.holder.current.tables["tiny"].pools[pool].workers)
