"""A real HTTP receiver for notification tests: it listens on a free port in
a thread, records every request, and answers with the statuses it is told
to (so a test can make it fail a few times, then recover)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from controlplane.alerts.labels import fingerprint
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class HTTPReceiver:
    url: str
    requests: list[Received] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)  # answered in turn; then 200

    def bodies(self, path: str | None = None) -> list[Any]:
        return [r.body for r in self.requests if path is None or r.path == path]


@contextmanager
def http_receiver() -> Iterator[HTTPReceiver]:
    state: dict[str, HTTPReceiver] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            receiver = state["r"]
            with lock:
                receiver.requests.append(Received(self.path, dict(self.headers), json.loads(raw or b"null")))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"ok" if status == 200 else b"receiver says no")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["r"] = HTTPReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["r"]
    finally:
        server.shutdown()
        server.server_close()


def firing_alert(labels: dict[str, str], at: datetime, **fields: Any) -> Alert:
    """An alert as evaluation leaves one that just fired."""
    labels = {"severity": "warning", **labels}
    return Alert.objects.create(
        fingerprint=fingerprint(labels),
        labels=labels,
        annotations=fields.pop("annotations", {"summary": "s"}),
        state=fields.pop("state", AlertState.FIRING),
        active_at=at,
        fired_at=at,
        state_changed_at=at,
        value=fields.pop("value", 1.0),
        **fields,
    )


def resolve(alert: Alert, at: datetime) -> None:
    alert.state, alert.resolved_at, alert.state_changed_at = AlertState.RESOLVED, at, at
    alert.save()
