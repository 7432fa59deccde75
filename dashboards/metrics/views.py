"""Metric pages: thin views over ``dashboards.metrics.pages``.

Each page renders whole for a plain GET and its live partial alone for htmx
(``request.htmx``); the websocket consumers push the same partial. Every
choice (grouping, range, window, cohort) is a plain link. A metrics backend
that does not answer (Prometheus down or slow) renders the page's frame
saying "metrics backend unavailable", status 503.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane import outages
from controlplane.accounts.roles import Role
from controlplane.fleet.models import Worker
from controlplane.metrics.models import ServiceObjectives
from controlplane.metrics.query import BackendUnavailable
from dashboards.access import role_required
from dashboards.live import HtmxHttpRequest
from dashboards.metrics import pages

log = logging.getLogger(__name__)


def _page(
    request: HtmxHttpRequest, name: str, template: str, view: pages.View, build: Callable[[], dict[str, Any]]
) -> HttpResponse:
    try:
        context = {**build(), **_links(view)}
    except BackendUnavailable as exc:
        # Prometheus down or slow: say so, in the page's frame, never a 500.
        context = {"view": view, "unavailable": exc.reason, "title": pages.TITLES[name], **_links(view)}
        partial = "metrics/partials/unavailable.html"
        log.warning("%s", exc)
        return outages.quiet(
            render(request, partial if request.htmx else "metrics/unavailable.html", context, status=503)
        )
    if request.htmx:
        return render(request, pages.PAGES[name].partial, context)
    return render(request, template, context)


def _links(view: pages.View) -> dict[str, Any]:
    return {
        "group_links": view.links("group_by", pages.PANEL_GROUPS),
        "range_links": view.links("range", pages.RANGES),
        "window_links": view.links("window", pages.WINDOWS),
    }


@role_required(Role.VIEWER)
def overview(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "overview", "metrics/overview.html", view, lambda: pages.overview_context(view))


@role_required(Role.VIEWER)
def panel(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "panel", "metrics/panel.html", view, lambda: pages.panel_context(view))


@role_required(Role.VIEWER)
def cohorts(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "cohorts", "metrics/cohorts.html", view, lambda: pages.compare_context(view))


@role_required(Role.VIEWER)
def lengths(request: HtmxHttpRequest) -> HttpResponse:
    view = pages.View.from_params(request.GET)
    return _page(request, "lengths", "metrics/lengths.html", view, lambda: pages.lengths_context(view))


@role_required(Role.VIEWER)
def worker(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    target = get_object_or_404(Worker.objects.select_related("pool", "running_revision__profile"), pk=pk)
    view = pages.View.from_params(request.GET)
    return _page(request, "worker", "metrics/worker.html", view, lambda: pages.worker_context(target, view))


@require_POST
@role_required(Role.OPERATOR)
def objectives(request: HtmxHttpRequest) -> HttpResponse:
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
