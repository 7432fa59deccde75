"""The gateway's tunables (``controlplane.conf``: settings, else environment, else these)."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from controlplane.conf import Tunable

GATEWAY_POLL_SECONDS = Tunable(
    "GATEWAY_POLL_SECONDS",
    5.0,
    "reload the routing state this often even without a notice (a fallback: changes arrive as notices; a reload "
    "costs the gateway about 6 ms of CPU, which at 1 s was the largest source of its P99 latency)",
)
GATEWAY_LIVENESS_TTL_SECONDS = Tunable(
    "GATEWAY_LIVENESS_TTL_SECONDS", 5.0, "a gateway silent this long no longer counts (acks)"
)
GATEWAY_HEARTBEAT_SECONDS = Tunable(
    "GATEWAY_HEARTBEAT_SECONDS", 1.0, "how often a gateway refreshes its liveness record"
)
GATEWAY_EJECT_SECONDS = Tunable(
    "GATEWAY_EJECT_SECONDS", 10.0, "a worker that refused a connection is passed over this long"
)
GATEWAY_MAX_ATTEMPTS = Tunable("GATEWAY_MAX_ATTEMPTS", 3, "workers tried per request before 503")
GATEWAY_CONNECT_TIMEOUT_SECONDS = Tunable("GATEWAY_CONNECT_TIMEOUT_SECONDS", 2.0, "connect timeout to a worker")
GATEWAY_READ_TIMEOUT_SECONDS = Tunable(
    "GATEWAY_READ_TIMEOUT_SECONDS",
    120.0,
    "a worker that took a request and sends no response head this long (it sends it with the first token, or with "
    "the whole reply when not streamed) gets the request aborted and the client a 504, not retried elsewhere; also "
    "the longest gap while a whole reply is read; 0: no limit",
)
GATEWAY_CLIENT_BODY_TIMEOUT_SECONDS = Tunable(
    "GATEWAY_CLIENT_BODY_TIMEOUT_SECONDS",
    10.0,
    "a client that began a request and sends nothing more of it (the rest of its head, or of the body it "
    "declared) this long gets a 408 and its connection closed",
)
GATEWAY_CLIENT_HEADER_TIMEOUT_SECONDS = Tunable(
    "GATEWAY_CLIENT_HEADER_TIMEOUT_SECONDS",
    10.0,
    "a client whose request line and headers are not all in this long after they began, however steadily "
    "they trickle, gets a 408 and its connection closed (nginx's client_header_timeout)",
)
GATEWAY_LOG_FLUSH_SECONDS = Tunable(
    "GATEWAY_LOG_FLUSH_SECONDS", 1.0, "request-log rows are written at least this often"
)
GATEWAY_LOG_BATCH_SIZE = Tunable("GATEWAY_LOG_BATCH_SIZE", 500, "... and as soon as this many are waiting")
GATEWAY_LOG_MAX_BACKLOG = Tunable(
    "GATEWAY_LOG_MAX_BACKLOG", 100_000, "rows held while the database is away; older ones are dropped"
)
GATEWAY_LOG_RETENTION_DAYS = Tunable("GATEWAY_LOG_RETENTION_DAYS", 7.0, "request-log rows older than this are deleted")
GATEWAY_LOG_PURGE_INTERVAL_SECONDS = Tunable(
    "GATEWAY_LOG_PURGE_INTERVAL_SECONDS", 3600.0, "how often Celery beat deletes old request-log rows"
)
GATEWAY_STREAM_SILENCE_SECONDS = Tunable(
    "GATEWAY_STREAM_SILENCE_SECONDS",
    10.0,
    "a stream in flight this long without a token counts as silent (the silent-streams gauges and alert)",
)
GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS = Tunable(
    "GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS",
    120.0,
    "a stream this long without a token is ended with an error event and logged as 598 (0: never)",
)
GATEWAY_STREAM_TRACKING = Tunable(
    "GATEWAY_STREAM_TRACKING",
    True,
    "track streams in flight (silence gauges, idle timeout); off only to measure what tracking costs (bench_gateway)",
)


def _channels_namespace() -> str:
    config: dict[str, Any] = settings.CHANNEL_LAYERS["default"]["CONFIG"]  # type: ignore[assignment]
    return f"{config.get('prefix', 'chunkpilot')}:gateway"


GATEWAY_REDIS_PREFIX = Tunable(
    "GATEWAY_REDIS_PREFIX",
    _channels_namespace,
    "Redis namespace of notices and acks",
    kind=str,
    shown_default="`<CHANNELS_PREFIX>:gateway`",
)
