"""This gateway's liveness record in Redis, which carries its acks.

Refreshed from the event loop: if the loop were wedged the record would
expire, and no rollout would wait on a gateway that serves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from controlplane.gateway import bus


class Presence:
    def __init__(self, redis_url: str, *, address: str, ttl_seconds: float):
        self.id = f"{socket.gethostname()}-{address.rsplit(':', 1)[-1]}-{uuid.uuid4().hex[:6]}"
        self.address = address
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        self.info = json.dumps(
            {"address": address, "hostname": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
        )
        self._acks = "{}"
        # The streams in flight that went silent (InFlight.summary), refreshed with every heartbeat.
        self.streams: Callable[[], dict[str, Any]] | None = None

    async def ack(self, epochs: dict[str, int]) -> None:
        """Record the epochs now applied; wake whoever waits on them if they changed."""
        acks = json.dumps(epochs, sort_keys=True)
        changed, self._acks = acks != self._acks, acks
        await self.refresh(publish=changed)

    async def refresh(self, *, publish: bool = False) -> None:
        key = bus.gateway_key(self.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"info": self.info, "acks": self._acks, "last_seen": repr(time.time())})
        if self.streams is not None:
            pipe.hset(key, "streams", json.dumps(self.streams()))
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
