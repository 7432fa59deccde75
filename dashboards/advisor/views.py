"""Advisor pages: thin views over ``dashboards.advisor.pages``."""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from controlplane import outages
from controlplane.accounts.roles import Role
from controlplane.advisor.models import FLEET
from controlplane.fleet.models import Pool
from controlplane.metrics.query import BackendUnavailable
from dashboards.access import role_required
from dashboards.advisor import pages

log = logging.getLogger(__name__)


@role_required(Role.VIEWER)
def advisor(request: HttpRequest) -> HttpResponse:
    return render(request, "advisor/advisor.html", pages.index_context())


@role_required(Role.VIEWER)
def report(request: HttpRequest, scope: str) -> HttpResponse:
    pool = None
    if scope != FLEET:
        pool = get_object_or_404(Pool.objects.select_related("desired_revision"), name=scope)
    try:
        context = pages.report_context(pool, pages.window_of(request.GET))
    except BackendUnavailable as exc:
        # Prometheus down or slow: say so, as the metric pages do, never a 500.
        log.warning("%s", exc)
        unavailable = {
            "scope": scope,
            "pool": pool,
            "unavailable": exc.reason,
            "view": {"query_string": request.GET.urlencode()},
        }
        return outages.quiet(render(request, "advisor/unavailable.html", unavailable, status=503))
    return render(request, "advisor/report.html", context)
