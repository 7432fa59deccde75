"""Notifications to people: an abort, a pause or a completion of a rollout
becomes an Alertmanager-style event through the alerts app's
``notify_event``, which routes it to its receivers (webhooks with
Alertmanager's payload): RolloutAborted (critical; info when a person asked
for it), RolloutPaused (warning), RolloutCompleted (info).

Sent after the transaction commits (a pager must never hear of a change that
was rolled back) and never fatal: the reconciler's work does not depend on a
webhook being there. Live pages hear of every change through
``controlplane.live`` (``Rollout.changed()``).
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.urls import NoReverseMatch, reverse

from controlplane.alerts.notify import notify_event

log = logging.getLogger(__name__)

NOTIFIED_KINDS = {"aborted": "critical", "paused": "warning", "succeeded": "info"}
EVENT_NAMES = {"aborted": "RolloutAborted", "paused": "RolloutPaused", "succeeded": "RolloutCompleted"}
# An abort a person asked for (the UI's button, the API) is news, not a page:
# "info", so no critical banner on every page. One the system decided (the
# analysis, the gate, the progress deadline, an alert's kill switch) pages.
PERSON_ABORT_SOURCES = ("ui", "api")


def severity(rollout: Any, kind: str) -> str:
    if kind == "aborted" and _aborted_on_request_of_a_person(rollout):
        return "info"
    return NOTIFIED_KINDS[kind]


def _aborted_on_request_of_a_person(rollout: Any) -> bool:
    """The last abort began with a person's request: its "aborting" entry
    carries the reason that request recorded."""
    events = rollout.events.order_by("-time", "-id")
    aborting = events.filter(kind="aborting").first()
    asked = events.filter(kind="abort_requested").first()
    return (
        aborting is not None
        and asked is not None
        and asked.message == aborting.message
        and (asked.data or {}).get("source") in PERSON_ABORT_SOURCES
    )


def notify(rollout: Any, kind: str, message: str) -> None:
    """An abort, pause or completion, to the alerts app's receivers."""
    if kind not in NOTIFIED_KINDS:
        return
    payload = event_payload(rollout, kind, message)
    transaction.on_commit(lambda: _notify(payload))


def event_payload(rollout: Any, kind: str, message: str) -> dict[str, Any]:
    labels = {
        "alertname": EVENT_NAMES[kind],
        "severity": severity(rollout, kind),
        "rollout": str(rollout.pk),
        # each pause (step, attempt) is an occurrence of its own
        "step": str(rollout.step_index + 1),
        "attempt": str(rollout.attempt),
        "pool": rollout.stable_pool.name,
        "canary_pool": rollout.canary_pool.name,
        "model": rollout.routing_table.model,
        "target_revision": str(rollout.target_revision),
    }
    try:
        url = settings.EXTERNAL_URL.rstrip("/") + reverse("rollout-detail", args=[rollout.pk])
    except NoReverseMatch:  # the page may not be installed
        url = settings.EXTERNAL_URL
    annotations = {
        "summary": f"rollout {rollout.pk} of {rollout.stable_pool.name} to {rollout.target_revision} {kind}",
        "description": message,
        "dashboard_url": url,
    }
    return {"labels": labels, "annotations": annotations}


def _notify(payload: dict[str, Any]) -> None:
    try:
        notify_event(labels=payload["labels"], annotations=payload["annotations"])
    except Exception:
        log.warning("could not notify %s", payload["labels"]["alertname"], exc_info=True)
