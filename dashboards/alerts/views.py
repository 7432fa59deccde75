"""The alert pages: alerts (firing and pending first, history below), one
alert, the rules and their editor with "test now", and silences.

Each page has one template; the alerts page's live part (the active table)
is a partial pushed by ``AlertsConsumer`` and fetched alone for htmx, as is
the critical-alert banner every page shows (``BannerConsumer``).
Buttons are plain POST forms that work without JavaScript.

The rule editor, the rule switch and the silence forms write through the
same audited model methods the alerts API calls.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.db import transaction
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.accounts.roles import Role, role_of
from controlplane.alerts import evaluation
from controlplane.alerts.models import Alert, AlertRule, Silence
from controlplane.metrics.query import BackendUnavailable, QueryError
from dashboards.access import role_required
from dashboards.alerts import pages
from dashboards.alerts.forms import AlertRuleForm, SilenceForm
from dashboards.live import HtmxHttpRequest


# ---- alerts ---------------------------------------------------------------------------
@role_required(Role.VIEWER)
def alerts(request: HtmxHttpRequest) -> HttpResponse:
    context = pages.active_context(request.GET)
    if request.htmx:
        return render(request, "alerts/partials/active.html", context)
    return render(request, "alerts/alerts.html", {**context, "history": pages.history()})


@role_required(Role.VIEWER)
def alert_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    alert = get_object_or_404(Alert.objects.select_related("rule"), pk=pk)
    return render(request, "alerts/alert_detail.html", pages.alert_context(alert))


@role_required(Role.VIEWER)
def banner(request: HtmxHttpRequest) -> HttpResponse:
    """The critical-alert banner alone, for htmx (the slow poll behind the push)."""
    return render(request, "alerts/partials/banner.html", pages.critical_alerts(request))


# ---- rules --------------------------------------------------------------------------------
@role_required(Role.VIEWER)
def rules(request: HtmxHttpRequest) -> HttpResponse:
    return render(request, "alerts/rules.html", pages.rules_context())


@role_required(Role.OPERATOR)
def rule_edit(request: HtmxHttpRequest, pk: int | None = None) -> HttpResponse:
    rule = get_object_or_404(AlertRule, pk=pk) if pk is not None else AlertRule()
    form = AlertRuleForm(request.POST or None, instance=rule)
    tested: dict[str, Any] | None = None
    if request.method == "POST" and form.is_valid():
        if request.POST.get("do") == "test":
            tested = _test(form.instance)  # no JavaScript: "test now" posts the whole form here
        else:
            rule = form.instance
            rule.updated_at = timezone.now()
            rule.save_audited(request.user)
            messages.success(request, f"Rule {rule.name} saved.")
            return redirect("alert-rules")
    return render(request, "alerts/rule_form.html", {"form": form, "rule": rule if pk else None, "tested": tested})


@require_POST
@role_required(Role.OPERATOR)
def rule_test(request: HtmxHttpRequest) -> HttpResponse:
    """ "Test now": the form as it stands, evaluated, nothing stored."""
    pk = request.POST.get("rule_id")
    rule = AlertRule.objects.filter(pk=pk).first() if pk and pk.isdigit() else None
    form = AlertRuleForm(request.POST, instance=rule or AlertRule())
    tested = _test(form.instance) if form.is_valid() else {"errors": form.errors}
    return render(request, "alerts/partials/test_result.html", {"tested": tested})


def _test(rule: AlertRule) -> dict[str, Any]:
    try:
        return {"condition": rule.describe_condition(), "groups": evaluation.preview(rule), "at": timezone.now()}
    except QueryError as exc:
        return {"errors": {exc.field: [exc.message]}}
    except BackendUnavailable as exc:
        return {"errors": {"metrics": [str(exc)]}}


@require_POST
@role_required(Role.OPERATOR)
def rule_toggle(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    with transaction.atomic():
        rule = get_object_or_404(AlertRule.objects.select_for_update(), pk=pk)
        rule.set_enabled(not rule.enabled, request.user)
    messages.success(request, f"Rule {rule.name} {'switched on' if rule.enabled else 'switched off'}.")
    return redirect("alert-rules")


# ---- silences ------------------------------------------------------------------------------
@role_required(Role.VIEWER)
def silences(request: HtmxHttpRequest) -> HttpResponse:
    form = SilenceForm(request.POST or None, initial={"matchers": request.GET.get("matchers", "")})
    if request.method == "POST":
        if role_of(request.user) < Role.OPERATOR:
            return HttpResponse("Silencing needs the operator role.", status=403)
        if form.is_valid():
            silence = Silence.create_audited(
                request.user,
                matchers=form.cleaned_data["parsed_matchers"],
                starts_at=form.cleaned_data["starts_at"],
                ends_at=form.cleaned_data["ends_at"],
                comment=form.cleaned_data["comment"],
                created_by=request.user.get_username(),
                author=_user(request),
            )
            messages.success(request, f"Silence {silence.pk} created until {silence.ends_at:%Y-%m-%d %H:%M} UTC.")
            return redirect("alert-silences")
    return render(request, "alerts/silences.html", {"form": form, "rows": pages.silence_rows()})


@require_POST
@role_required(Role.OPERATOR)
def silence_expire(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    with transaction.atomic():
        silence = get_object_or_404(Silence.objects.select_for_update(), pk=pk)
        silence.expire_by(request.user)
    messages.success(request, f"Silence {silence.pk} expired.")
    return redirect("alert-silences")


def _user(request: HtmxHttpRequest) -> Any:
    """The signed-in user (role_required let only those in)."""
    return request.user if request.user.is_authenticated else None
