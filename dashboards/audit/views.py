"""The audit log page: newest first, filtered by action prefix and actor."""

from __future__ import annotations

from django.http import HttpResponse
from django.shortcuts import render

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from dashboards.access import role_required
from dashboards.live import HtmxHttpRequest

AUDIT_PAGE_SIZE = 200


@role_required(Role.VIEWER)
def audit_log(request: HtmxHttpRequest) -> HttpResponse:
    events = AuditEvent.objects.all()
    if prefix := request.GET.get("action", "").strip():
        events = events.filter(action__startswith=prefix)
    if actor := request.GET.get("actor", "").strip():
        events = events.filter(actor_repr=actor)
    return render(
        request,
        "audit/audit.html",
        {"events": events[:AUDIT_PAGE_SIZE], "action": prefix, "actor": actor, "page_size": AUDIT_PAGE_SIZE},
    )
