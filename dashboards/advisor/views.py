"""Advisor pages: thin views over ``dashboards.advisor.pages``."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from controlplane.accounts.roles import Role
from controlplane.advisor.models import FLEET
from controlplane.fleet.models import Pool
from dashboards.access import role_required
from dashboards.advisor import pages


@role_required(Role.VIEWER)
def advisor(request: HttpRequest) -> HttpResponse:
    return render(request, "advisor/advisor.html", pages.index_context())


@role_required(Role.VIEWER)
def report(request: HttpRequest, scope: str) -> HttpResponse:
    pool = None
    if scope != FLEET:
        pool = get_object_or_404(Pool.objects.select_related("desired_revision"), name=scope)
    return render(request, "advisor/report.html", pages.report_context(pool, pages.window_of(request.GET)))
