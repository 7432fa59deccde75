"""The audit log page: newest first, filtered by action prefix and actor,
a page at a time; each event shows what changed (``pages.changes``)."""

from __future__ import annotations

from urllib.parse import urlencode

from django.core.paginator import Paginator
from django.http import HttpResponse
from django.shortcuts import render

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from dashboards.access import role_required
from dashboards.audit import pages
from dashboards.live import HtmxHttpRequest

AUDIT_PAGE_SIZE = 50


@role_required(Role.VIEWER)
def audit_log(request: HtmxHttpRequest) -> HttpResponse:
    events = AuditEvent.objects.all()
    if prefix := request.GET.get("action", "").strip():
        events = events.filter(action__startswith=prefix)
    if actor := request.GET.get("actor", "").strip():
        events = events.filter(actor_repr=actor)
    page = Paginator(events, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))  # a bad number: the nearest page
    filters = {k: v for k, v in (("action", prefix), ("actor", actor)) if v}

    def link(number: int) -> str:
        return "?" + urlencode({**filters, "page": number})

    return render(
        request,
        "audit/audit.html",
        {
            "rows": pages.rows(page),
            "page": page,
            "newer_url": link(page.previous_page_number()) if page.has_previous() else "",
            "older_url": link(page.next_page_number()) if page.has_next() else "",
            "action": prefix,
            "actor": actor,
            "page_size": AUDIT_PAGE_SIZE,
        },
    )
