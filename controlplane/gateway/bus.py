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
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import redis

from controlplane import embedded
from controlplane.gateway import conf

log = logging.getLogger(__name__)

NOTICE_ROUTING = "routing"
NOTICE_KEYS = "keys"


def prefix() -> str:
    return conf.GATEWAY_REDIS_PREFIX.get()


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

    embedded.lease_if_embedded()
    return _client(settings.REDIS_URL)


def publish_notice(kind: str, **fields: Any) -> None:
    """Tell gateways to reload now. Never fatal: they poll anyway."""
    try:
        client().publish(notices_channel(), json.dumps({"kind": kind, **fields}))
    except redis.RedisError as exc:
        log.warning("could not publish a %s notice (%s); gateways will see it on their next poll", kind, exc)


@dataclass(frozen=True)
class GatewayInfo:
    id: str
    address: str
    hostname: str
    pid: int
    started_at: float  # unix time
    last_seen: float  # unix time of its last liveness refresh
    acks: dict[str, int]  # table id → epoch applied
    streams: dict[str, Any] = field(default_factory=dict)  # its streams in flight (inflight.InFlight.summary)

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
            streams=_streams(raw.get(b"streams")),
        )
    except (ValueError, TypeError, AttributeError):
        log.warning("gateway %s has an unreadable liveness record", instance_id)
        return None


def _streams(raw: bytes | None) -> dict[str, Any]:
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def silent_streams(gateways: list[GatewayInfo] | None = None) -> list[dict[str, Any]]:
    """Streams silent past each gateway's threshold, summed over the live
    gateways by model, cohort, pool and worker: [{model, cohort, pool, worker, streams}]."""
    totals: dict[tuple[str, str, str, str], int] = {}
    for gateway in live_gateways() if gateways is None else gateways:
        for item in gateway.streams.get("silent") or []:
            if not isinstance(item, dict) or not isinstance(item.get("streams"), int):
                continue
            key = (
                str(item.get("model", "")),
                str(item.get("cohort", "")),
                str(item.get("pool", "")),
                str(item.get("worker", "")),
            )
            totals[key] = totals.get(key, 0) + item["streams"]
    return [
        {"model": m, "cohort": c, "pool": p, "worker": w, "streams": n} for (m, c, p, w), n in sorted(totals.items())
    ]


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


def live_gateways_if_known(conn: redis.Redis | None = None) -> list[GatewayInfo] | None:
    """``live_gateways()``, or None while Redis is unreachable: who is live
    is then unknown, which is not the same as nobody."""
    try:
        return live_gateways(conn)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        log.warning("Redis unreachable; gateway acks unknown: %s", exc)
        return None


ACKS_COMPLETE = "complete"
ACKS_PENDING = "pending"
ACKS_UNKNOWN = "unknown"  # Redis is unreachable: nobody can say


@dataclass(frozen=True)
class AckStatus:
    """Where the gateways stand on one table's epoch (``gateways`` None: unknown)."""

    table_id: int
    epoch: int
    gateways: list[GatewayInfo] | None

    @property
    def pending(self) -> list[GatewayInfo]:
        return [g for g in self.gateways or [] if g.acked(self.table_id) < self.epoch]

    @property
    def complete(self) -> bool:
        """Every live gateway applied ``epoch`` (or a later one). True with no
        gateway at all: nothing routes by the old weights then. Never while
        unknown: a rollout waits rather than guess."""
        return self.gateways is not None and not self.pending

    @property
    def state(self) -> str:
        if self.gateways is None:
            return ACKS_UNKNOWN
        return ACKS_COMPLETE if self.complete else ACKS_PENDING

    def as_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "state": self.state,
            "complete": self.complete,
            "gateways": [
                {**g.as_dict(), "acked_epoch": g.acked(self.table_id), "current": g.acked(self.table_id) >= self.epoch}
                for g in self.gateways or []
            ],
        }


def ack_status(table_id: int, epoch: int, conn: redis.Redis | None = None) -> AckStatus:
    return AckStatus(table_id, epoch, live_gateways_if_known(conn))


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
