"""What the fleet pages show, built once for the page, the htmx refresh and
the websocket push alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.template.loader import render_to_string
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import FLAG_ACTIONS, Pool, Worker
from dashboards.audit import pages as audit_pages

HISTORY_LIMIT = 50
# Rows on one fleet page: what the page, its 30-s refresh and a push for a
# worker that came or went render, however large the fleet (a page of 200
# rows took longer to render than the 300 ms a page may take).
PAGE_SIZE = 50


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


@dataclass(frozen=True)
class View:
    """Which rows a fleet page shows: one pool's (or every pool's), one page
    of them. Read from the page's query string, and from its websocket's,
    so a push renders the same rows the page shows."""

    pool: str = ""
    page: str = "1"

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> View:
        return cls(pool=params.get("pool", "").strip(), page=params.get("page", "1"))

    def query(self, **changes: Any) -> str:
        """This view's query string (``changes`` applied), without defaults."""
        values = {"pool": self.pool, "page": self.page, **changes}
        return urlencode({k: v for k, v in values.items() if v and (k, str(v)) != ("page", "1")})

    def rows(self, now: datetime) -> tuple[Page[Worker], list[dict[str, Any]]]:
        chosen = workers().filter(pool__name=self.pool) if self.pool else workers()
        page = Paginator(chosen, PAGE_SIZE).get_page(self.page)  # a bad number: the nearest page
        return page, [row_context(w, now) for w in page]


def page_context(view: View | None = None) -> dict[str, Any]:
    view = view or View()
    now = timezone.now()
    page, rows = view.rows(now)
    return {
        "rows": rows,
        "summary": summary(),
        "now": now,
        "view": view,
        "page": page,
        "query": view.query(),
        "pool_names": list(Pool.objects.order_by("name").values_list("name", flat=True)),
        "prev_query": view.query(page=page.previous_page_number()) if page.has_previous() else None,
        "next_query": view.query(page=page.next_page_number()) if page.has_next() else None,
    }


def worker_context(worker: Worker) -> dict[str, Any]:
    """One worker's page: its row's figures, its audit history, its buttons."""
    events = AuditEvent.objects.filter(object_type="fleet.worker", object_id=str(worker.pk))[:HISTORY_LIMIT]
    return {**row_context(worker, timezone.now()), "audit_rows": audit_pages.rows(events), "flag_actions": FLAG_ACTIONS}


def render_push(
    worker_id: int, *, created: bool, deleted: bool, user_context: dict[str, Any], view: View | None = None
) -> list[str]:
    """The websocket messages for one change: the changed row (or, when a row
    appears or goes, the page's table body: one page, never the whole
    fleet), then the summary, each an htmx out-of-band swap."""
    view = view or View()
    now = timezone.now()
    context = {**user_context, "summary": summary(), "now": now, "oob": True, "query": view.query()}
    worker = None if deleted else workers().filter(pk=worker_id).first()
    if created or worker is None:
        context["page"], context["rows"] = view.rows(now)
        rows = render_to_string("fleet/partials/fleet_rows.html", context)
    else:
        rows = render_to_string("fleet/partials/worker_row.html", {**context, **row_context(worker, now)})
    return [rows, render_to_string("fleet/partials/fleet_summary.html", context)]
