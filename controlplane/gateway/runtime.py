"""The gateway process around the request path: everything that touches the
database or Redis, none of it on a request's way.

* ``load_state()`` reads the routing tables, the routable workers of their
  pools and the active client keys into a ``GatewayState`` (three queries).
* ``Refresher`` keeps the holder current: it reloads on a notice (Redis
  pub/sub for routing and key changes; the fleet's channel-layer group for
  worker changes) and every ``GATEWAY_POLL_SECONDS`` regardless, then acks
  the epochs it applied. Loads run on one dedicated thread, so a slow
  database delays the next snapshot, never a request.
* ``Presence`` is this gateway's liveness record in Redis (the acks live in
  it), refreshed from the event loop: if the loop were wedged the record
  would expire, and no rollout would wait on a gateway that serves nothing.
* ``LogWriter`` drains request records into ``RequestLog`` with
  ``bulk_create`` on its own thread, in batches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
from django.db import DatabaseError, IntegrityError, close_old_connections

from controlplane.gateway import bus
from controlplane.gateway.cohort import Role
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.proxy import RequestRecord
from controlplane.gateway.state import (
    ClientKeyInfo,
    GatewayState,
    PoolTarget,
    StateHolder,
    TableTarget,
    WorkerTarget,
    build_table,
    newest,
    with_table_update,
)

log = logging.getLogger(__name__)


# ---- the snapshot ------------------------------------------------------------------
def load_state() -> GatewayState:
    """One consistent view of what gateways route by.

    Each table comes with its pools in a single statement, so the epoch a
    gateway acks is always the epoch of the weights it applies."""
    from controlplane.fleet.models import Worker
    from controlplane.gateway.models import ClientKey, RoutingTable

    close_old_connections()
    rows = RoutingTable.objects.values_list(
        "id", "model", "salt", "epoch", "pools__pool_id", "pools__pool__name", "pools__role", "pools__weight_bp"
    )
    tables: dict[int, tuple[str, str, int]] = {}
    members: dict[int, list[tuple[int, str, str, int]]] = collections.defaultdict(list)
    for table_id, model, salt, epoch, pool_id, pool_name, role, weight_bp in rows:
        tables[table_id] = (model, salt, epoch)
        if pool_id is not None:
            members[table_id].append((pool_id, pool_name, role, weight_bp))
    pool_ids = {m[0] for ms in members.values() for m in ms}
    workers: dict[int, list[WorkerTarget]] = collections.defaultdict(list)
    for wid, name, url, pool_id, revision_id, max_model_len in (
        Worker.objects.routable()
        .filter(pool_id__in=pool_ids)
        .order_by("id")
        .values_list("id", "name", "url", "pool_id", "running_revision_id", "max_model_len")
    ):
        workers[pool_id].append(WorkerTarget(wid, name, url.rstrip("/"), pool_id, revision_id, max_model_len))
    keys = {
        key_hash: ClientKeyInfo(kid, is_admin)
        for kid, key_hash, is_admin in ClientKey.objects.filter(active=True).values_list("id", "key_hash", "is_admin")
    }
    built: dict[str, TableTarget] = {}
    for table_id, (model, salt, epoch) in tables.items():
        pools = [
            PoolTarget(pool_id, pool_name, Role(role), weight_bp, tuple(workers.get(pool_id, ())))
            for pool_id, pool_name, role, weight_bp in members[table_id]
        ]
        built[model] = build_table(id=table_id, model=model, salt=salt, epoch=epoch, pools=pools)
    return GatewayState(tables=built, keys=keys, loaded_at=time.monotonic())


# ---- liveness and acks ------------------------------------------------------------------
class Presence:
    def __init__(self, redis_url: str, *, address: str, ttl_seconds: float):
        self.id = f"{socket.gethostname()}-{address.rsplit(':', 1)[-1]}-{uuid.uuid4().hex[:6]}"
        self.address = address
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        self.info = json.dumps({"address": address, "hostname": socket.gethostname(), "pid": os.getpid(),
                                "started_at": time.time()})
        self._acks = "{}"

    async def ack(self, epochs: dict[str, int]) -> None:
        """Record the epochs now applied; wake whoever waits on them if they changed."""
        acks = json.dumps(epochs, sort_keys=True)
        changed, self._acks = acks != self._acks, acks
        await self.refresh(publish=changed)

    async def refresh(self, *, publish: bool = False) -> None:
        key = bus.gateway_key(self.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"info": self.info, "acks": self._acks, "last_seen": repr(time.time())})
        pipe.pexpire(key, self.ttl_ms)
        pipe.zadd(bus.live_key(), {self.id: time.time()})
        if publish:
            pipe.publish(bus.acks_channel(), self.id)
        await pipe.execute()

    async def withdraw(self) -> None:
        with contextlib.suppress(Exception):
            await self.redis.delete(bus.gateway_key(self.id))
            await self.redis.zrem(bus.live_key(), self.id)
        with contextlib.suppress(Exception):
            await self.redis.aclose()


# ---- keeping the state current -------------------------------------------------------------
class Refresher:
    def __init__(
        self,
        holder: StateHolder,
        presence: Presence,
        *,
        load: Callable[[], GatewayState] = load_state,
        poll_seconds: float,
        heartbeat_seconds: float,
        redis_url: str,
    ):
        self.holder = holder
        self.presence = presence
        self.load = load
        self.poll_seconds = poll_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.redis_url = redis_url
        self._wake = asyncio.Event()
        self._ack_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-db")
        self._tasks: list[asyncio.Task[None]] = []
        self.num_loads = 0

    async def start(self) -> None:
        """First snapshot before serving (waits for the database a while),
        then the loops."""
        deadline = time.monotonic() + 30
        while True:
            try:
                await self._reload()
                break
            except Exception:  # noqa: BLE001 - logged; the loops keep trying
                if time.monotonic() > deadline:
                    log.exception("no routing state yet; serving 503 until the database answers")
                    break
                await asyncio.sleep(0.5)
        self._tasks = [
            asyncio.ensure_future(self._reload_loop()),
            asyncio.ensure_future(self._notice_loop()),
            asyncio.ensure_future(self._fleet_loop()),
            asyncio.ensure_future(self._heartbeat_loop()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.presence.withdraw()
        self._executor.shutdown(wait=False)

    def wake(self) -> None:
        self._wake.set()

    async def _reload(self) -> None:
        loaded = await asyncio.get_running_loop().run_in_executor(self._executor, self.load)
        self.holder.swap(newest(loaded, self.holder.current))
        self.num_loads += 1
        await self._ack()

    async def _ack(self) -> None:
        """Ack what the holder has now. Serialized, and always the current
        state, so the acks a gateway publishes never go backwards."""
        async with self._ack_lock:
            epochs = self.holder.current.epochs()
            try:
                await self.presence.ack(epochs)
            except Exception:  # noqa: BLE001 - the heartbeat retries; the state is applied regardless
                log.warning("could not ack epochs %s", epochs, exc_info=True)

    def on_notice(self, data: bytes | str) -> None:
        """A routing change that carries its table is applied at once; every
        notice also wakes a full reload (workers, keys, new tables)."""
        try:
            notice = json.loads(data)
        except ValueError:
            notice = None
        if isinstance(notice, dict) and notice.get("kind") == bus.NOTICE_ROUTING and "pools" in notice:
            updated = with_table_update(self.holder.current, notice)
            if updated is not None:
                self.holder.swap(updated)
                self._tasks.append(asyncio.ensure_future(self._ack()))
                self._tasks = [t for t in self._tasks if not t.done()]
        self.wake()

    async def _reload_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
            # Cleared before the load: a notice that lands during it is for
            # a newer state, and wakes the next round at once.
            self._wake.clear()
            try:
                await self._reload()
            except Exception:  # noqa: BLE001
                log.warning("could not reload the routing state; keeping the last one", exc_info=True)
                await asyncio.sleep(min(self.poll_seconds, 1.0))

    async def _notice_loop(self) -> None:
        while True:
            conn = aioredis.Redis.from_url(self.redis_url, socket_connect_timeout=2)
            pubsub = conn.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(bus.notices_channel())
                self.wake()  # anything missed while unsubscribed
                async for message in pubsub.listen():
                    self.on_notice(message.get("data", b""))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - polling covers the gap
                log.warning("lost the notice channel; polling until it is back", exc_info=True)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                    await conn.aclose()

    async def _fleet_loop(self) -> None:
        """Worker changes (state, cordon, drain) from the fleet's live-page
        events: reload at once rather than at the next poll."""
        from channels.layers import get_channel_layer

        from controlplane.fleet.events import FLEET_GROUP

        while True:
            try:
                layer = get_channel_layer()
                if layer is None:
                    return
                channel = await layer.new_channel("gateway.")
                await layer.group_add(FLEET_GROUP, channel)
                joined = time.monotonic()
                while True:
                    await layer.receive(channel)
                    self.wake()
                    if time.monotonic() - joined > 3600:  # group membership expires after a day
                        await layer.group_add(FLEET_GROUP, channel)
                        joined = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - polling covers the gap
                log.warning("lost the fleet events; polling until they are back", exc_info=True)
                await asyncio.sleep(2.0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self.presence.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.warning("could not refresh this gateway's liveness record", exc_info=True)


# ---- the request log -------------------------------------------------------------------------
class LogWriter(threading.Thread):
    """Batches ``RequestRecord``s into ``RequestLog`` rows off the event loop.

    ``put`` is a deque append: it never blocks. While the database is away
    rows wait, up to ``max_backlog``; past that the oldest are dropped and
    counted, because a log must never take the gateway down with it."""

    def __init__(self, *, flush_seconds: float, batch_size: int, max_backlog: int,
                 metrics: GatewayMetrics | None = None):
        super().__init__(name="gateway-log", daemon=True)
        self.flush_seconds = flush_seconds
        self.batch_size = batch_size
        self.max_backlog = max_backlog
        self.metrics = metrics
        self._rows: collections.deque[RequestRecord] = collections.deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.num_written = 0

    def put(self, record: RequestRecord) -> None:
        self._rows.append(record)
        if len(self._rows) > self.max_backlog:
            with contextlib.suppress(IndexError):
                self._rows.popleft()
                if self.metrics is not None:
                    self.metrics.log_dropped.inc()
        if len(self._rows) >= self.batch_size:
            self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is left (waiting up to ``timeout`` for the database)."""
        self._stopping.set()
        self._wake.set()
        self.join(timeout)
        log.info("request log: %d rows written, %d left unwritten", self.num_written, len(self._rows))

    def run(self) -> None:
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            stopping = self._stopping.is_set()
            while self._rows:
                if not self.flush_once():
                    if stopping:
                        log.error("dropping %d request-log rows at shutdown: the database is away", len(self._rows))
                        return
                    time.sleep(min(self.flush_seconds, 1.0))
                    break
            if stopping:
                return

    def flush_once(self) -> bool:
        batch: list[RequestRecord] = []
        with contextlib.suppress(IndexError):
            while len(batch) < self.batch_size:
                batch.append(self._rows.popleft())
        if not batch:
            return True
        try:
            close_old_connections()
            write_records(batch)
        except DatabaseError:
            log.warning("could not write %d request-log rows; will retry", len(batch), exc_info=True)
            self._rows.extendleft(reversed(batch))
            return False
        self.num_written += len(batch)
        return True


# RequestLog's columns in the order _values() gives them.
COLUMNS = (
    "request_id", "created_at", "model", "cohort", "pool_id", "worker_id", "profile_revision_id", "api_key_id",
    "prompt_tokens", "cached_tokens", "output_tokens", "ttft_seconds", "max_gap_seconds", "tpot_seconds",
    "e2e_seconds", "status", "error", "stream",
)


def _values(r: RequestRecord) -> tuple[Any, ...]:
    return (
        r.request_id, _datetime(r.created_at), r.model, r.cohort, r.pool_id, r.worker_id, r.profile_revision_id,
        r.api_key_id, r.prompt_tokens, r.cached_tokens, r.output_tokens, r.ttft_seconds, r.max_gap_seconds,
        r.tpot_seconds, r.e2e_seconds, r.status, r.error, r.stream,
    )


def write_records(batch: list[RequestRecord]) -> None:
    """Insert the rows: with COPY on PostgreSQL (building ORM objects cost
    the gateway about 90 µs of CPU per row, which it shares with the event
    loop), bulk_create elsewhere."""
    from django.db import connection, transaction

    from controlplane.gateway.models import ClientKey, RequestLog

    try:
        if connection.vendor == "postgresql":
            with transaction.atomic():  # the deferred foreign keys are checked here
                with connection.cursor() as cursor:
                    table = connection.ops.quote_name(RequestLog._meta.db_table)
                    with cursor.cursor.copy(f"COPY {table} ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                        for r in batch:
                            copy.write_row(_values(r))
        else:
            RequestLog.objects.bulk_create([_row(r) for r in batch])
    except IntegrityError:
        # A worker, pool, revision or key was deleted since the snapshot: keep
        # the rows, without the references that no longer exist.
        rows = [_row(r) for r in batch]
        _drop_dangling(rows)
        RequestLog.objects.bulk_create(rows)
    last_used: dict[int, float] = {}
    for r in batch:
        if r.api_key_id is not None:
            last_used[r.api_key_id] = max(last_used.get(r.api_key_id, 0.0), r.created_at)
    for key_id, when in last_used.items():
        ClientKey.objects.filter(pk=key_id).update(last_used=_datetime(when))


def _datetime(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, tz=UTC)


def _row(r: RequestRecord) -> Any:
    from controlplane.gateway.models import RequestLog

    return RequestLog(**dict(zip(COLUMNS, _values(r), strict=True)))  # attnames: pool_id=, worker_id=, ...


def _drop_dangling(rows: list[Any]) -> None:
    from controlplane.fleet.models import Pool, Worker
    from controlplane.gateway.models import ClientKey
    from controlplane.profiles.models import ProfileRevision

    for attr, model in (("pool_id", Pool), ("worker_id", Worker), ("profile_revision_id", ProfileRevision),
                        ("api_key_id", ClientKey)):
        ids = {getattr(r, attr) for r in rows} - {None}
        existing = set(model.objects.filter(pk__in=ids).values_list("pk", flat=True))
        for r in rows:
            if getattr(r, attr) not in existing:
                setattr(r, attr, None)
