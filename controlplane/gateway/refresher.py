"""Keeps a gateway's routing state current, off the request path.

* ``load_state()`` reads the routing tables, the routable workers of their
  pools and the active client keys into a ``GatewayState`` (three queries).
* ``Refresher`` keeps the holder current: it reloads on a notice (Redis
  pub/sub for routing and key changes; the fleet's domain event
  ``fleet.worker_changed`` for worker changes) and every ``GATEWAY_POLL_SECONDS`` regardless, then acks
  the epochs it applied through ``Presence``. Loads run on one dedicated
  thread, so a slow database delays the next snapshot, never a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis
from django.db import close_old_connections

from controlplane import live
from controlplane.fleet.models import Worker
from controlplane.fleet.pools import PoolRole
from controlplane.gateway import bus
from controlplane.gateway.models import ClientKey, RoutingTable
from controlplane.gateway.presence import Presence
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
    close_old_connections()
    rows = RoutingTable.objects.values_list(
        "id",
        "model",
        "salt",
        "epoch",
        "max_output_tokens",
        "pools__pool_id",
        "pools__pool__name",
        "pools__role",
        "pools__weight_bp",
    )
    tables: dict[int, tuple[str, str, int, int | None]] = {}
    members: dict[int, list[tuple[int, str, str, int]]] = collections.defaultdict(list)
    for table_id, model, salt, epoch, max_output_tokens, pool_id, pool_name, role, weight_bp in rows:
        tables[table_id] = (model, salt, epoch, max_output_tokens)
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
        key_hash: ClientKeyInfo(kid, is_admin, max_output_tokens)
        for kid, key_hash, is_admin, max_output_tokens in ClientKey.objects.filter(active=True).values_list(
            "id", "key_hash", "is_admin", "max_output_tokens"
        )
    }
    built: dict[str, TableTarget] = {}
    for table_id, (model, salt, epoch, max_output_tokens) in tables.items():
        pools = [
            PoolTarget(pool_id, pool_name, PoolRole(role), weight_bp, tuple(workers.get(pool_id, ())))
            for pool_id, pool_name, role, weight_bp in members[table_id]
        ]
        built[model] = build_table(
            id=table_id, model=model, salt=salt, epoch=epoch, pools=pools, max_output_tokens=max_output_tokens
        )
    return GatewayState(tables=built, keys=keys, loaded_at=time.monotonic())


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
            except Exception:
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
            except Exception:
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
            except Exception:
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
            except Exception:
                log.warning("lost the notice channel; polling until it is back", exc_info=True)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                    await conn.aclose()

    async def _fleet_loop(self) -> None:
        """Worker changes (state, cordon, drain), the fleet's domain event
        ``live.Event.WORKER_CHANGED``: reload at once rather than at the next
        poll."""
        from channels.layers import get_channel_layer

        fleet_group = live.group(live.Event.WORKER_CHANGED)
        while True:
            try:
                layer = get_channel_layer()
                if layer is None:
                    return
                channel = await layer.new_channel("gateway.")
                await layer.group_add(fleet_group, channel)
                joined = time.monotonic()
                while True:
                    await layer.receive(channel)
                    self.wake()
                    if time.monotonic() - joined > 3600:  # group membership expires after a day
                        await layer.group_add(fleet_group, channel)
                        joined = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("lost the fleet events; polling until they are back", exc_info=True)
                await asyncio.sleep(2.0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self.presence.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("could not refresh this gateway's liveness record", exc_info=True)
