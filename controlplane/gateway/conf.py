"""The gateway's settings, each overridable in settings.py or the environment.

| setting | default | meaning |
|---|---|---|
| GATEWAY_POLL_SECONDS | 5.0 | reload the routing state this often even without a notice (a fallback: changes arrive as notices; a reload costs the gateway about 6 ms of CPU, which at 1 s was the largest source of its P99 latency) |
| GATEWAY_LIVENESS_TTL_SECONDS | 5.0 | a gateway silent this long no longer counts (acks) |
| GATEWAY_HEARTBEAT_SECONDS | 1.0 | how often a gateway refreshes its liveness record |
| GATEWAY_EJECT_SECONDS | 10.0 | a worker that refused a connection is passed over this long |
| GATEWAY_MAX_ATTEMPTS | 3 | workers tried per request before 503 |
| GATEWAY_CONNECT_TIMEOUT_SECONDS | 2.0 | connect timeout to a worker |
| GATEWAY_LOG_FLUSH_SECONDS | 1.0 | request-log rows are written at least this often |
| GATEWAY_LOG_BATCH_SIZE | 500 | ... and as soon as this many are waiting |
| GATEWAY_LOG_MAX_BACKLOG | 100000 | rows held while the database is away; older ones are dropped |
| GATEWAY_LOG_RETENTION_DAYS | 7 | request-log rows older than this are deleted (Celery beat, hourly) |
| GATEWAY_UPSTREAM_CLIENT | native | how to call workers: native (httptools) or httpx (see upstream.py) |
| GATEWAY_REDIS_PREFIX | <channels prefix>:gateway | Redis namespace of notices and acks |
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings

from controlplane.conf import setting_from

DEFAULTS: dict[str, Any] = {
    "GATEWAY_POLL_SECONDS": 5.0,
    "GATEWAY_LIVENESS_TTL_SECONDS": 5.0,
    "GATEWAY_HEARTBEAT_SECONDS": 1.0,
    "GATEWAY_EJECT_SECONDS": 10.0,
    "GATEWAY_MAX_ATTEMPTS": 3,
    "GATEWAY_CONNECT_TIMEOUT_SECONDS": 2.0,
    "GATEWAY_LOG_FLUSH_SECONDS": 1.0,
    "GATEWAY_LOG_BATCH_SIZE": 500,
    "GATEWAY_LOG_MAX_BACKLOG": 100_000,
    "GATEWAY_LOG_RETENTION_DAYS": 7.0,
    "GATEWAY_LOG_PURGE_INTERVAL_SECONDS": 3600.0,
    "GATEWAY_UPSTREAM_CLIENT": "native",
}


def get(name: str) -> Any:
    """settings.NAME, else the environment variable NAME, else the default."""
    return setting_from(DEFAULTS, name)


def redis_prefix() -> str:
    explicit = getattr(settings, "GATEWAY_REDIS_PREFIX", None) or os.environ.get("GATEWAY_REDIS_PREFIX")
    if explicit:
        return str(explicit)
    config: dict[str, Any] = settings.CHANNEL_LAYERS["default"]["CONFIG"]  # type: ignore[assignment]
    channels_prefix = config.get("prefix", "chunkpilot")
    return f"{channels_prefix}:gateway"
