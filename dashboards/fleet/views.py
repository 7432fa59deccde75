"""The fleet pages: every worker (live), one worker, and its buttons."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from controlplane.accounts.roles import Role
from controlplane.fleet.models import FLAG_ACTIONS, Worker
from dashboards.access import role_required
from dashboards.fleet import pages
from dashboards.live import HtmxHttpRequest


@role_required(Role.VIEWER)
def fleet(request: HtmxHttpRequest) -> HttpResponse:
    context = pages.page_context(pages.View.from_params(request.GET))
    if request.htmx:
        return render(request, "fleet/partials/fleet_rows.html", context)
    return render(request, "fleet/fleet.html", context)


@role_required(Role.VIEWER)
def worker_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    worker = get_object_or_404(pages.workers(), pk=pk)
    return render(request, "fleet/worker_detail.html", pages.worker_context(worker))


@require_POST
@role_required(Role.OPERATOR)
def worker_action(request: HtmxHttpRequest, pk: int, verb: str) -> HttpResponse:
    if verb not in FLAG_ACTIONS:
        raise Http404(f"no action {verb}")
    worker = get_object_or_404(Worker, pk=pk)
    worker.flag_action(verb, request.user)
    if request.htmx:
        worker = pages.workers().get(pk=pk)
        return render(request, "fleet/partials/worker_row.html", pages.row_context(worker, timezone.now()))
    messages.success(request, f"{worker.name}: {verb} requested.")
    next_url = request.POST.get("next", "")
    if next_url and url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
        return redirect(next_url)
    return redirect("worker-detail", pk=pk)
