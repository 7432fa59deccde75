"""Rollout changes pushed to live pages, and notifications to people.

Both go out after the transaction commits (a page or a pager must never hear
of a change that was rolled back) and neither is fatal: the reconciler's
work does not depend on a browser or a webhook being there.

* ``rollout_changed``: one ``group_send`` per group — the rollout's own
  detail page and the rollout list — handled by the consumer's
  ``rollout_changed()``.
* ``notify``: an abort, a pause or a completion becomes an Alertmanager-style
  event through the alerts app's ``notify_event``, which routes it to its
  receivers (webhooks with Alertmanager's payload): RolloutAborted
  (critical), RolloutPaused (warning), RolloutCompleted (info).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

log = logging.getLogger(__name__)

LIST_GROUP = "rollouts"
ROLLOUT_CHANGED = "rollout.changed"  # handled by the consumer's rollout_changed()
NOTIFIED_KINDS = {"aborted": "critical", "paused": "warning", "succeeded": "info"}
EVENT_NAMES = {"aborted": "RolloutAborted", "paused": "RolloutPaused", "succeeded": "RolloutCompleted"}


def group_for(rollout_id: int) -> str:
    return f"rollout-{rollout_id}"


def rollout_changed(rollout_id: int) -> None:
    message = {"type": ROLLOUT_CHANGED, "rollout_id": rollout_id}
    transaction.on_commit(lambda: _send([group_for(rollout_id), LIST_GROUP], message))


def _send(groups: list[str], message: dict[str, Any]) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    try:
        layer = get_channel_layer()
        if layer is None:
            return
        for group in groups:
            async_to_sync(layer.group_send)(group, message)
    except Exception:  # noqa: BLE001 - a live page is a convenience
        log.warning("could not push %s", message["type"], exc_info=True)


def notify(rollout: Any, kind: str, message: str) -> None:
    """An abort, pause or completion, to the alerts app's receivers."""
    if kind not in NOTIFIED_KINDS:
        return
    payload = event_payload(rollout, kind, message)
    transaction.on_commit(lambda: _notify(payload))


def event_payload(rollout: Any, kind: str, message: str) -> dict[str, Any]:
    from django.conf import settings
    from django.urls import reverse

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
    except Exception:  # noqa: BLE001 - the page may not be installed
        url = settings.EXTERNAL_URL
    annotations = {
        "summary": f"rollout {rollout.pk} of {rollout.stable_pool.name} to {rollout.target_revision} {kind}",
        "description": message,
        "dashboard_url": url,
    }
    return {"labels": labels, "annotations": annotations}


def _notify(payload: dict[str, Any]) -> None:
    try:
        from controlplane.alerts.notify import notify_event
    except ImportError:
        log.info("no notifier installed; not sent: %s", payload["annotations"]["summary"])
        return
    try:
        notify_event(labels=payload["labels"], annotations=payload["annotations"])
    except Exception:  # noqa: BLE001 - a lost notification must not stop a rollout
        log.warning("could not notify %s", payload["labels"]["alertname"], exc_info=True)
