"""``python manage.py rungateway [--host H] [--port P]``: the OpenAI-compatible
entry point, a process of its own. Stateless: run as many as you like; each
registers itself in Redis and acks the routing epochs it applies."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from controlplane import embedded
from controlplane.gateway import conf
from controlplane.gateway.log_writer import LogWriter
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.presence import Presence
from controlplane.gateway.proxy import Gateway, ProxySettings
from controlplane.gateway.refresher import Refresher
from controlplane.gateway.server import ServerSettings, serve
from controlplane.gateway.state import StateHolder
from controlplane.gateway.upstream import Upstream, UpstreamClient, UpstreamTimeouts

log = logging.getLogger("controlplane.gateway")


def build_gateway(
    address: str, *, upstream_class: Callable[[UpstreamTimeouts], UpstreamClient] = Upstream
) -> tuple[Gateway, LogWriter]:
    """The app with its refresher and log writer wired in (not started).
    ``upstream_class`` is the gateway's own client but for a benchmark's
    comparison (``controlplane/bench/upstream.py``)."""
    holder = StateHolder()
    metrics = GatewayMetrics()
    writer = LogWriter(
        flush_seconds=conf.GATEWAY_LOG_FLUSH_SECONDS.get(),
        batch_size=conf.GATEWAY_LOG_BATCH_SIZE.get(),
        max_backlog=conf.GATEWAY_LOG_MAX_BACKLOG.get(),
        metrics=metrics,
    )
    embedded.lease_if_embedded()  # presence and the refresher's subscription are Redis
    presence = Presence(settings.REDIS_URL, address=address, ttl_seconds=conf.GATEWAY_LIVENESS_TTL_SECONDS.get())
    refresher = Refresher(
        holder,
        presence,
        poll_seconds=conf.GATEWAY_POLL_SECONDS.get(),
        heartbeat_seconds=conf.GATEWAY_HEARTBEAT_SECONDS.get(),
        redis_url=settings.REDIS_URL,
    )
    timeouts = UpstreamTimeouts(
        connect_seconds=conf.GATEWAY_CONNECT_TIMEOUT_SECONDS.get(),
        read_seconds=conf.GATEWAY_READ_TIMEOUT_SECONDS.get() or None,
    )
    app = Gateway(
        holder,
        record=writer.put,
        metrics=metrics,
        settings=ProxySettings(
            max_attempts=conf.GATEWAY_MAX_ATTEMPTS.get(),
            eject_seconds=conf.GATEWAY_EJECT_SECONDS.get(),
            stream_silence_seconds=conf.GATEWAY_STREAM_SILENCE_SECONDS.get(),
            stream_idle_timeout_seconds=conf.GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS.get(),
            track_streams=conf.GATEWAY_STREAM_TRACKING.get(),
        ),
        upstream_factory=lambda: upstream_class(timeouts),
        on_startup=[refresher.start],
        # The log's last rows are flushed on shutdown, after the requests in flight have ended.
        on_shutdown=[refresher.stop, lambda: asyncio.to_thread(writer.stop)],
    )
    presence.streams = app.inflight.summary  # the silent streams travel with the liveness record
    app.refresher = refresher  # type: ignore[attr-defined]
    return app, writer


class Command(BaseCommand):
    help = "Run the gateway: OpenAI's API in front of the workers, with sticky weighted routing."
    upstream_class: Callable[[UpstreamTimeouts], UpstreamClient] = Upstream

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8080)
        parser.add_argument("--advertise", help="host:port others know this gateway by (default: --host:--port)")
        parser.add_argument("--log-level", default="info")

    def handle(self, *args: Any, **options: Any) -> None:
        import sys

        import uvloop

        # The log writer and the snapshot loader are threads: when they hold
        # the GIL, the event loop waits up to the switch interval (5 ms by
        # default) on every wakeup. A stream's next token must not: 0.1 ms.
        sys.setswitchinterval(0.0001)
        # Those threads live as long as the process: each keeps its database
        # connection instead of opening one per poll and per flush, which cost
        # the loop a connect's worth of GIL time twice a second. No health
        # check before each use either (a query of its own, every poll): a
        # connection that broke fails one load or flush, which is retried, and
        # Django replaces a connection that had errors before the next use.
        from django.db import connections

        for alias in connections:
            connections.settings[alias]["CONN_MAX_AGE"] = None
            connections.settings[alias]["CONN_HEALTH_CHECKS"] = False

        address = options["advertise"] or f"{options['host']}:{options['port']}"
        app, writer = build_gateway(address, upstream_class=self.upstream_class)
        writer.start()
        logging.getLogger("controlplane").setLevel(options["log_level"].upper())

        def ready() -> None:
            log.info("gateway %s listening on %s:%s", address, options["host"], options["port"])

        server_settings = ServerSettings(
            body_timeout_seconds=conf.GATEWAY_CLIENT_BODY_TIMEOUT_SECONDS.get(),
            head_timeout_seconds=conf.GATEWAY_CLIENT_HEADER_TIMEOUT_SECONDS.get(),
        )
        uvloop.run(
            serve(
                app.handle,
                options["host"],
                options["port"],
                settings=server_settings,
                startup=app.startup,
                shutdown=app.shutdown,
                ready=ready,
            )
        )
