"""The one way to say "X changed": named events over the channel layer.

A model method that changes something other processes show or act on
publishes an event; the web UI's consumers (``dashboards/``) re-render
their live partials, and the gateway reloads its routing snapshot. See
docs/architecture.md, "Live updates".

* An event goes to its group, ``group(event)``, and to one scoped group per
  scope (``group(event, 12)``: "rollouts.changed.12"), so a page about one
  thing joins only that thing's group.
* Sent after the transaction commits (at once outside one): nobody may hear
  of a change that was rolled back.
* Safe inside a running event loop (a script or a test that drives
  Playwright): ``async_to_sync`` refuses to run there, so the send goes
  through a short-lived thread.
* Never fatal: a heartbeat, a scrape or a reconciler tick does not depend on
  Redis being there. A lost event is logged; every page also polls slowly
  or re-renders on the next event, and the gateway polls.

Channels calls the handler named after the event with dots as underscores
(``fleet.worker_changed`` → ``fleet_worker_changed``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict, overload

from asgiref.sync import async_to_sync
from channels.layers import BaseChannelLayer, get_channel_layer
from django.db import transaction

from controlplane import embedded, outages

log = logging.getLogger(__name__)

# How long sync code inside a running loop waits for the send's thread: an
# event is a convenience, the caller's work is not.
SEND_TIMEOUT_SECONDS = 5.0


class Event(StrEnum):
    WORKER_CHANGED = "fleet.worker_changed"  # WorkerChanged
    METRICS_SCRAPED = "metrics.scraped"  # MetricsScraped; scoped by worker id
    ROLLOUT_CHANGED = "rollouts.changed"  # RolloutChanged; scoped by rollout id
    ALERTS_CHANGED = "alerts.changed"  # AlertsChanged
    EXPERIMENT_CHANGED = "experiments.changed"  # ExperimentChanged; scoped by experiment id

    @property
    def handler(self) -> str:
        """The consumer method Channels calls for it."""
        return self.value.replace(".", "_")


# What each event's message carries besides ``type`` (the event's value).
class WorkerChanged(TypedDict):
    type: str
    worker_id: int
    created: NotRequired[bool]
    deleted: NotRequired[bool]


class MetricsScraped(TypedDict):
    type: str
    at: float  # the round's start (with the Prometheus backend, beat's tick), unix seconds
    worker_ids: list[int]


class RolloutChanged(TypedDict):
    type: str
    rollout_id: int


class AlertsChanged(TypedDict):
    type: str
    alert_ids: list[int]  # the alerts whose state changed; may be empty


class ExperimentChanged(TypedDict):
    type: str
    experiment_id: int


def group(event: Event, scope: object | None = None) -> str:
    """The channel-layer group for an event, or for one scope of it."""
    return event.value if scope is None else f"{event.value}.{scope}"


# The message type of each event, which ``publish``'s overloads below follow field for field.
MESSAGES: dict[Event, type] = {
    Event.WORKER_CHANGED: WorkerChanged,
    Event.METRICS_SCRAPED: MetricsScraped,
    Event.ROLLOUT_CHANGED: RolloutChanged,
    Event.ALERTS_CHANGED: AlertsChanged,
    Event.EXPERIMENT_CHANGED: ExperimentChanged,
}


# One signature per event, so a publish with a field its message lacks, or
# without one it needs, is a type error where it is written.
@overload
def publish(
    event: Literal[Event.WORKER_CHANGED],
    *,
    scopes: Iterable[object] = (),
    worker_id: int,
    created: bool = ...,
    deleted: bool = ...,
) -> None: ...
@overload
def publish(
    event: Literal[Event.METRICS_SCRAPED], *, scopes: Iterable[object] = (), at: float, worker_ids: list[int]
) -> None: ...
@overload
def publish(event: Literal[Event.ROLLOUT_CHANGED], *, scopes: Iterable[object] = (), rollout_id: int) -> None: ...
@overload
def publish(event: Literal[Event.ALERTS_CHANGED], *, scopes: Iterable[object] = (), alert_ids: list[int]) -> None: ...
@overload
def publish(event: Literal[Event.EXPERIMENT_CHANGED], *, scopes: Iterable[object] = (), experiment_id: int) -> None: ...
def publish(event: Event, *, scopes: Iterable[object] = (), **fields: Any) -> None:
    """Tell every listener of ``event`` (and of each of ``scopes``) after the
    current transaction commits. Never raises."""
    message = {"type": event.value, **fields}
    groups = [group(event), *(group(event, scope) for scope in scopes)]
    transaction.on_commit(lambda: _send(groups, message), robust=True)


def _send(groups: list[str], message: dict[str, Any]) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _send_now(groups, message)
        return
    thread = threading.Thread(target=_send_now, args=(groups, message), name="live-publish", daemon=True)
    thread.start()
    thread.join(SEND_TIMEOUT_SECONDS)


def _send_now(groups: list[str], message: dict[str, Any]) -> None:
    try:
        embedded.lease_if_embedded()  # the channel layer is Redis
        layer = get_channel_layer()
        if layer is not None:
            async_to_sync(_send_all)(layer, groups, message)
    except Exception as exc:
        # Redis away is an outage, not a bug: one line, no traceback.
        outage = outages.store_down(exc) is not None
        log.warning("could not publish %s to %s: %s", message["type"], ", ".join(groups), exc, exc_info=not outage)


async def _send_all(layer: BaseChannelLayer, groups: list[str], message: dict[str, Any]) -> None:
    for name in groups:
        await layer.group_send(name, message)
