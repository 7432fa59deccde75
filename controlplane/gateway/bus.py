"""Routing epochs over Redis: notices to gateways, and their acks back.

    control plane                         Redis                      gateway
    set_weights() ─ commit ─ PUBLISH ──▶ <p>:notices ──────────▶ reload from the DB
                                                                      │
    wait_for_acks() ◀─ SUBSCRIBE ─── <p>:acks ◀── PUBLISH ──┐         ▼
           └──── reads ────▶ <p>:gw:<id> (HASH, TTL) ◀── HSET ┴── ack its epochs

Each gateway keeps one hash with a liveness TTL: who it is, and the epoch it
last applied of each table (``acks``, by table id, so a table deleted and
made again never inherits old acks). A gateway that stops refreshing it
expires, and no longer holds a rollout up. ``<p>:live`` indexes the hashes so
listing needs no SCAN; a member whose hash expired is dead and is pruned.

Notices are hints: gateways also poll, so a lost notice delays a change by
one poll interval, never loses it. ``<p>`` is the deployment's Redis
namespace (the channel-layer prefix, plus ``:gateway``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import redis

from controlplane.gateway import conf

log = logging.getLogger(__name__)

NOTICE_ROUTING = "routing"
NOTICE_KEYS = "keys"


def prefix() -> str:
    return conf.redis_prefix()


def notices_channel() -> str:
    return f"{prefix()}:notices"


def acks_channel() -> str:
    return f"{prefix()}:acks"


def live_key() -> str:
    return f"{prefix()}:live"


def gateway_key(instance_id: str) -> str:
    return f"{prefix()}:gw:{instance_id}"


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=30)


def client() -> redis.Redis:
    from django.conf import settings

    return _client(settings.REDIS_URL)


def publish_notice(kind: str, **fields: Any) -> None:
    """Tell gateways to reload now. Never fatal: they poll anyway."""
    try:
        client().publish(notices_channel(), json.dumps({"kind": kind, **fields}))
    except redis.RedisError:
        log.warning("could not publish a %s notice; gateways will see it on their next poll", kind, exc_info=True)


@dataclass(frozen=True)
class GatewayInfo:
    id: str
    address: str
    hostname: str
    pid: int
    started_at: float  # unix time
    last_seen: float  # unix time of its last liveness refresh
    acks: dict[str, int]  # table id → epoch applied

    def acked(self, table_id: int) -> int:
        return self.acks.get(str(table_id), 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "address": self.address,
            "hostname": self.hostname,
            "pid": self.pid,
            "started_at": self.started_at,
            "last_seen": self.last_seen,
            "acks": dict(self.acks),
        }


def _parse(instance_id: str, raw: dict[bytes, bytes]) -> GatewayInfo | None:
    if not raw:
        return None
    try:
        info = json.loads(raw.get(b"info", b"{}"))
        acks = {str(k): int(v) for k, v in json.loads(raw.get(b"acks", b"{}")).items()}
        return GatewayInfo(
            id=instance_id,
            address=str(info.get("address", "")),
            hostname=str(info.get("hostname", "")),
            pid=int(info.get("pid", 0)),
            started_at=float(info.get("started_at", 0.0)),
            last_seen=float(raw.get(b"last_seen", b"0")),
            acks=acks,
        )
    except (ValueError, TypeError, AttributeError):
        log.warning("gateway %s has an unreadable liveness record", instance_id)
        return None


def live_gateways(conn: redis.Redis | None = None) -> list[GatewayInfo]:
    """Every gateway whose liveness record has not expired, by id."""
    conn = conn or client()
    ids = [m.decode() for m in conn.zrange(live_key(), 0, -1)]  # type: ignore[union-attr]
    if not ids:
        return []
    pipe = conn.pipeline(transaction=False)
    for instance_id in ids:
        pipe.hgetall(gateway_key(instance_id))
    gateways: list[GatewayInfo] = []
    dead: list[str] = []
    for instance_id, raw in zip(ids, pipe.execute(), strict=True):
        info = _parse(instance_id, raw)
        if info is None:
            dead.append(instance_id)
        else:
            gateways.append(info)
    if dead:
        conn.zrem(live_key(), *dead)
    return sorted(gateways, key=lambda g: g.id)


@dataclass(frozen=True)
class AckStatus:
    """Where the gateways stand on one table's epoch."""

    table_id: int
    epoch: int
    gateways: list[GatewayInfo]

    @property
    def pending(self) -> list[GatewayInfo]:
        return [g for g in self.gateways if g.acked(self.table_id) < self.epoch]

    @property
    def complete(self) -> bool:
        """Every live gateway applied ``epoch`` (or a later one). True with no
        gateway at all: nothing routes by the old weights then."""
        return not self.pending

    def as_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "complete": self.complete,
            "gateways": [
                {**g.as_dict(), "acked_epoch": g.acked(self.table_id), "current": g.acked(self.table_id) >= self.epoch}
                for g in self.gateways
            ],
        }


def ack_status(table_id: int, epoch: int, conn: redis.Redis | None = None) -> AckStatus:
    return AckStatus(table_id, epoch, live_gateways(conn))


def wait_for_acks(table_id: int, epoch: int, timeout_seconds: float) -> AckStatus:
    """Block until every live gateway acks ``epoch`` of the table, or the time
    is up; returns the last status either way (check ``complete``).

    Looks first (gateways often ack before the caller gets here); otherwise
    subscribes and looks again, so an ack that lands in between still wakes
    it, then re-reads on every ack and at least every 50 ms, so a gateway that
    dies meanwhile drops out as soon as its record expires."""
    conn = client()
    deadline = time.monotonic() + timeout_seconds
    status = ack_status(table_id, epoch, conn)
    if status.complete or timeout_seconds <= 0:
        return status
    pubsub = conn.pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe(acks_channel())
        while True:
            status = ack_status(table_id, epoch, conn)
            remaining = deadline - time.monotonic()
            if status.complete or remaining <= 0:
                return status
            message = pubsub.get_message(timeout=min(remaining, 0.05))
            # Drain a burst of acks (one per gateway) before re-reading.
            while message is not None:
                message = pubsub.get_message(timeout=0)
    finally:
        pubsub.close()


def forget_gateway(instance_id: str) -> None:
    conn = client()
    conn.delete(gateway_key(instance_id))
    conn.zrem(live_key(), instance_id)
