"""The Requests pages: the gateways' request log, searched (list) and one
request's timeline (detail). Both read through ``gateway.explorer``, as the
API does, so the page, the API and the exports agree."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import DatabaseError
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, render

from controlplane.accounts.roles import Role
from controlplane.gateway import explorer
from controlplane.gateway.models import RequestLog
from dashboards.access import role_required
from dashboards.live import HtmxHttpRequest
from dashboards.requests import pages


@role_required(Role.VIEWER)
def request_list(request: HtmxHttpRequest) -> HttpResponse:
    context = pages.list_context(request.GET)
    try:
        query = explorer.parse(request.GET)
        rows, cursor = query.page()
    except ValidationError as exc:
        return render(request, "requests/list.html", {**context, "errors": exc.message_dict}, status=400)
    except DatabaseError:
        return render(request, "requests/list.html", {**context, "store_down": True}, status=503)
    return render(
        request, "requests/list.html", {**context, "rows": rows, "next_url": pages.next_url(request.GET, cursor)}
    )


@role_required(Role.VIEWER)
def request_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    row = get_object_or_404(RequestLog.objects.select_related("pool", "worker", "profile_revision__profile"), pk=pk)
    return render(request, "requests/detail.html", pages.detail_context(row))
