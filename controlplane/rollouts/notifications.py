"""Notifications to people: an abort, a pause or a completion of a rollout
becomes an Alertmanager-style event through the alerts app's
``notify_event``, which routes it to its receivers (webhooks with
Alertmanager's payload): RolloutAborted (critical), RolloutPaused (warning),
RolloutCompleted (info).

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


def notify(rollout: Any, kind: str, message: str) -> None:
    """An abort, pause or completion, to the alerts app's receivers."""
    if kind not in NOTIFIED_KINDS:
        return
    payload = event_payload(rollout, kind, message)
    transaction.on_commit(lambda: _notify(payload))


def event_payload(rollout: Any, kind: str, message: str) -> dict[str, Any]:
    labels = {
        "alertname": EVENT_NAMES[kind],
        "severity": NOTIFIED_KINDS[kind],
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
