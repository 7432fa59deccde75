"""Metric pages: thin views over ``dashboards.metrics_pages``.

Each page renders whole for a plain GET and its live partial alone for htmx
(``request.htmx``); the websocket consumers push the same partial. Every
choice (grouping, range, window, cohort) is a plain link.
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from django_htmx.middleware import HtmxDetails

from controlplane.accounts.roles import Role
from controlplane.metrics.models import ServiceObjectives
from dashboards import metrics_pages as pages
from dashboards.access import role_required


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


def _page(request: HtmxHttpRequest, name: str, template: str, context: dict) -> HttpResponse:
    if request.htmx:
        return render(request, pages.PAGES[name][1], context)
    return render(request, template, context)


def _links(view: pages.View) -> dict:
    return {
        "group_links": view.links("group_by", pages.PANEL_GROUPS),
        "range_links": view.links("range", pages.RANGES),
        "window_links": view.links("window", pages.WINDOWS),
    }


@role_required(Role.VIEWER)
def overview(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "overview", "metrics/overview.html", {**pages.overview_context(view), **_links(view)})


@role_required(Role.VIEWER)
def panel(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "panel", "metrics/panel.html", {**pages.panel_context(view), **_links(view)})


@role_required(Role.VIEWER)
def cohorts(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "cohorts", "metrics/cohorts.html", {**pages.compare_context(view), **_links(view)})


@role_required(Role.VIEWER)
def lengths(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "lengths", "metrics/lengths.html", {**pages.lengths_context(view), **_links(view)})


@role_required(Role.VIEWER)
def worker(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    from controlplane.fleet.models import Worker

    target = get_object_or_404(Worker.objects.select_related("pool", "running_revision__profile"), pk=pk)
    view = pages.View.from_params(request.GET)
    return _page(request, "worker", "metrics/worker.html", {**pages.worker_context(target, view), **_links(view)})


@require_POST
@role_required(Role.OPERATOR)
def objectives(request: HttpRequest) -> HttpResponse:
    try:
        ttft, tpot = float(request.POST["ttft_seconds"]), float(request.POST["tpot_seconds"])
        if not (0 < ttft <= 3600 and 0 < tpot <= 600):
            raise ValueError
    except (KeyError, ValueError):
        messages.error(request, "Objectives are positive numbers of seconds (TTFT up to 3600, TPOT up to 600).")
        return redirect("metrics-overview")
    ServiceObjectives.current().change(ttft, tpot, actor=request.user)
    messages.success(request, f"Goodput now counts requests with TTFT ≤ {ttft:g} s and TPOT ≤ {tpot:g} s.")
    return redirect("metrics-overview")
