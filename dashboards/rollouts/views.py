"""The rollout pages: the list, one rollout live, and "New rollout".

Each page has one template; its live part (``dashboards.rollouts.pages``) is
a partial that htmx fetches on its own and the rollout consumers push on
every transition. Buttons are plain POST forms that ask for confirmation
when JavaScript is there and work without it; they only set flags.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from controlplane.accounts.roles import Role
from controlplane.gateway.models import RoutingTable
from controlplane.rollouts import steps as plan
from controlplane.rollouts.models import Rollout
from dashboards.access import role_required
from dashboards.live import HtmxHttpRequest
from dashboards.rollouts import pages
from dashboards.rollouts.forms import RolloutForm


@role_required(Role.VIEWER)
def rollout_list(request: HtmxHttpRequest) -> HttpResponse:
    context = pages.list_context()
    if request.htmx:
        return render(request, "rollouts/partials/rows.html", context)
    return render(request, "rollouts/list.html", context)


@role_required(Role.VIEWER)
def rollout_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    rollout = get_object_or_404(pages.base_queryset(), pk=pk)
    context = pages.detail_context(rollout)
    if request.htmx:
        return render(request, "rollouts/partials/live.html", context)
    return render(request, "rollouts/detail.html", context)


@require_POST
@role_required(Role.OPERATOR)
def rollout_action(request: HtmxHttpRequest, pk: int, verb: str) -> HttpResponse:
    if verb not in pages.BUTTONS:
        raise Http404(f"no action {verb}")
    rollout = get_object_or_404(pages.base_queryset(), pk=pk)
    button = pages.BUTTONS[verb]
    error = False
    try:
        if verb == "abort":
            reason = request.POST.get("reason", "").strip()[:500]
            if not rollout.request_abort(request.user, reason, source="ui"):
                raise ValidationError(f"the rollout has {rollout.phase_label}; nothing to abort.")
        elif verb == "rollback":
            back = rollout.rollback(request.user)
            messages.success(request, f"Rollback started: rollout {back.pk}.")
            location = reverse("rollout-detail", args=[back.pk])
            if request.htmx:  # a new page: let htmx navigate there
                return HttpResponse(status=204, headers={"HX-Redirect": location})
            return redirect(location)
        else:
            rollout.request(button.flag, request.user)
    except ValidationError as exc:
        text, error = " ".join(exc.messages), True
    else:
        text = f"{button.label} requested; the reconciler acts on it."
    if request.htmx:
        rollout = pages.base_queryset().get(pk=pk)
        return render(
            request,
            "rollouts/partials/live.html",
            {**pages.detail_context(rollout), "action_message": text, "action_error": error},
        )
    (messages.error if error else messages.success)(request, text)
    return redirect("rollout-detail", pk=pk)


@role_required(Role.OPERATOR)
def rollout_new(request: HtmxHttpRequest) -> HttpResponse:
    initial: dict[str, Any] = {}
    if revision := request.GET.get("revision"):
        initial["target_revision"] = revision
    tables = list(RoutingTable.objects.prefetch_related("pools__pool"))
    if len(tables) == 1:
        roles = {m.role: m.pool.name for m in tables[0].pools.all()}
        initial.update(
            model=tables[0].model,
            stable_pool=roles.get("stable"),
            canary_pool=roles.get("canary"),
            baseline_pool=roles.get("baseline"),
        )
    form = RolloutForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        v = form.cleaned_data
        template = v.get("analysis_template")
        try:
            rollout = Rollout.start(
                routing_table=v["model"],
                stable_pool=v["stable_pool"],
                canary_pool=v["canary_pool"],
                baseline_pool=v.get("baseline_pool"),
                target_revision=v["target_revision"],
                steps=plan.to_json(plan.default_plan(template.name if template else plan.DEFAULT_TEMPLATE)),
                progress_deadline_seconds=v["progress_deadline_seconds"],
                gate={"enabled": bool(v["gate_enabled"])},
                actor=request.user,
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                target = field if field in form.fields else None
                if field == "gate":
                    target = "gate_enabled"
                for error in errors:
                    form.add_error(target, error)
        else:
            messages.success(request, f"Rollout {rollout.pk} started.")
            return redirect("rollout-detail", pk=rollout.pk)
    default_steps = [s.describe() for s in plan.default_plan()]
    return render(request, "rollouts/new.html", {"form": form, "default_steps": default_steps, "tables": tables})
