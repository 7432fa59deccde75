"""What the fleet pages show, built once for the page, the htmx refresh and
the websocket push alike."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.template.loader import render_to_string
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import FLAG_ACTIONS, Worker
from dashboards.audit import pages as audit_pages

HISTORY_LIMIT = 50


@dataclass(frozen=True)
class StateCount:
    label: str
    count: int


def workers() -> QuerySet[Worker]:
    return Worker.objects.select_related(
        "pool__desired_revision__profile", "desired_revision__profile", "running_revision__profile"
    ).order_by("pool__name", "name")


def summary() -> dict[str, Any]:
    counts = Counter(Worker.objects.values_list("state", flat=True))
    return {
        "states": [StateCount(state.label, counts.get(state.value, 0)) for state in WorkerState],
        "total": sum(counts.values()),
        "drifting": Worker.objects.drifting().count(),
    }


def row_context(worker: Worker, now: datetime) -> dict[str, Any]:
    return {
        "w": worker,
        "desired": worker.effective_desired_revision(),
        "drifting": worker.is_drifting(now),
        "now": now,
    }


def page_context() -> dict[str, Any]:
    now = timezone.now()
    return {"rows": [row_context(w, now) for w in workers()], "summary": summary(), "now": now}


def worker_context(worker: Worker) -> dict[str, Any]:
    """One worker's page: its row's figures, its audit history, its buttons."""
    events = AuditEvent.objects.filter(object_type="fleet.worker", object_id=str(worker.pk))[:HISTORY_LIMIT]
    return {**row_context(worker, timezone.now()), "audit_rows": audit_pages.rows(events), "flag_actions": FLAG_ACTIONS}


def render_push(worker_id: int, *, created: bool, deleted: bool, user_context: dict[str, Any]) -> list[str]:
    """The websocket messages for one change: the changed row (or, when a row
    appears or goes, the whole table body), then the summary, each an htmx
    out-of-band swap."""
    now = timezone.now()
    context = {**user_context, "summary": summary(), "now": now, "oob": True}
    worker = None if deleted else workers().filter(pk=worker_id).first()
    if created or worker is None:
        context["rows"] = [row_context(w, now) for w in workers()]
        rows = render_to_string("fleet/partials/fleet_rows.html", context)
    else:
        rows = render_to_string("fleet/partials/worker_row.html", {**context, **row_context(worker, now)})
    return [rows, render_to_string("fleet/partials/fleet_summary.html", context)]
