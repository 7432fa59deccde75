"""Request-log retention: beat deletes rows older than
GATEWAY_LOG_RETENTION_DAYS every GATEWAY_LOG_PURGE_INTERVAL_SECONDS. Safe to
run twice at once (both delete the same old rows; neither fails)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from controlplane.celery import app
from controlplane.gateway import conf
from controlplane.gateway.models import RequestLog


@app.task(name="gateway.purge_request_log")
def purge_request_log() -> int:
    days = conf.GATEWAY_LOG_RETENTION_DAYS.get()
    return RequestLog.purge(older_than=timedelta(days=days))


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    interval = conf.GATEWAY_LOG_PURGE_INTERVAL_SECONDS.get()
    sender.add_periodic_task(interval, purge_request_log.s(), name="gateway request-log retention", expires=interval)
