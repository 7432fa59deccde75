"""The alert pages: alerts (firing and pending first, history below), one
alert, the rules and their editor with "test now", and silences.

Each page has one template; the alerts page's live part (the active table)
is a partial htmx polls, as is the critical-alert banner every page shows.
Buttons are plain POST forms that work without JavaScript; every write goes
through the model and writes its audit row.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane import audit
from controlplane.accounts.roles import Role
from controlplane.alerts import evaluation
from controlplane.alerts.context_processors import critical_alerts
from controlplane.alerts.engine import State
from controlplane.alerts.labels import Matcher
from controlplane.alerts.models import Alert, AlertRule, AlertTransition, Delivery, Silence
from controlplane.metrics.query import QueryError
from dashboards.access import role_required
from dashboards.forms_alerts import AlertRuleForm, SilenceForm

HISTORY_LIMIT = 200
STATES = [s.label for s in State]


# ---- alerts ---------------------------------------------------------------------------
def active_context(request: HttpRequest) -> dict[str, Any]:
    now = timezone.now()
    silences = list(Silence.objects.active_at(now))
    alerts = Alert.objects.active().select_related("rule").order_by("-state", "-fired_at", "-active_at")
    severity = request.GET.get("severity", "")
    if severity:
        alerts = alerts.filter(labels__severity=severity)
    rows = []
    for alert in alerts[:500]:
        silenced = alert.silenced_by(silences)
        if request.GET.get("silenced") == "hide" and silenced:
            continue
        rows.append({"alert": alert, "silenced_by": silenced, "annotations": alert.live_annotations(),
                     "silence_url": silence_url(alert)})
    return {"rows": rows, "severity": severity, "now": now, "hide_silenced": request.GET.get("silenced") == "hide"}


def silence_url(alert: Alert) -> str:
    """The silences page with a form that matches this alert exactly."""
    matchers = "\n".join(str(Matcher(k, "=", v)) for k, v in sorted(alert.labels.items()))
    return f"{reverse('alert-silences')}?{urlencode({'matchers': matchers})}"


@role_required(Role.VIEWER)
def alerts(request: HttpRequest) -> HttpResponse:
    context = active_context(request)
    if getattr(request, "htmx", False):
        return render(request, "alerts/partials/active.html", context)
    history = AlertTransition.objects.select_related("alert").order_by("-at", "-id")[:HISTORY_LIMIT]
    return render(request, "alerts/alerts.html", {**context, "history": history})


@role_required(Role.VIEWER)
def alert_detail(request: HttpRequest, pk: int) -> HttpResponse:
    alert = get_object_or_404(Alert.objects.select_related("rule"), pk=pk)
    silences = [s for s in Silence.objects.filter(ends_at__gt=timezone.now()) if s.matches(alert.labels)]
    deliveries = Delivery.objects.filter(fingerprints__contains=[alert.fingerprint]).select_related("receiver")[:50]
    return render(request, "alerts/alert_detail.html", {
        "alert": alert, "annotations": alert.live_annotations(), "transitions": alert.transitions.all()[:200],
        "deliveries": deliveries, "silences": silences, "silence_url": silence_url(alert),
    })


@role_required(Role.VIEWER)
def banner(request: HttpRequest) -> HttpResponse:
    """The critical-alert banner alone, for the poll on every page."""
    return render(request, "alerts/partials/banner.html", critical_alerts(request))


# ---- rules --------------------------------------------------------------------------------
@role_required(Role.VIEWER)
def rules(request: HttpRequest) -> HttpResponse:
    counts: dict[int, int] = {}
    for rule_id in Alert.objects.active().values_list("rule_id", flat=True):
        counts[rule_id] = counts.get(rule_id, 0) + 1
    rows = [{"rule": rule, "num_active": counts.get(rule.pk, 0)} for rule in AlertRule.objects.all()]
    return render(request, "alerts/rules.html", {"rows": rows})


@role_required(Role.OPERATOR)
def rule_edit(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    rule = get_object_or_404(AlertRule, pk=pk) if pk is not None else AlertRule()
    before = audit.snapshot(rule) if pk is not None else None
    form = AlertRuleForm(request.POST or None, instance=rule)
    tested: dict[str, Any] | None = None
    if request.method == "POST" and form.is_valid():
        if request.POST.get("do") == "test":
            tested = _test(form.instance)  # no JavaScript: "test now" posts the whole form here
        else:
            with transaction.atomic():
                rule = form.instance
                rule.updated_at = timezone.now()
                rule.save()
                audit.record(request.user, f"alert_rule.{'update' if pk else 'create'}", rule, before,
                             audit.snapshot(rule))
            messages.success(request, f"Rule {rule.name} saved.")
            return redirect("alert-rules")
    return render(request, "alerts/rule_form.html", {"form": form, "rule": rule if pk else None, "tested": tested})


@require_POST
@role_required(Role.OPERATOR)
def rule_test(request: HttpRequest) -> HttpResponse:
    """"Test now": the form as it stands, evaluated, nothing stored."""
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


@require_POST
@role_required(Role.OPERATOR)
def rule_toggle(request: HttpRequest, pk: int) -> HttpResponse:
    with transaction.atomic():
        rule = get_object_or_404(AlertRule.objects.select_for_update(), pk=pk)
        rule.enabled = not rule.enabled
        rule.updated_at = timezone.now()
        rule.save(update_fields=["enabled", "updated_at"])
        audit.record(request.user, "alert_rule.update", rule, {"enabled": not rule.enabled}, {"enabled": rule.enabled})
    messages.success(request, f"Rule {rule.name} {'switched on' if rule.enabled else 'switched off'}.")
    return redirect("alert-rules")


# ---- silences ------------------------------------------------------------------------------
@role_required(Role.VIEWER)
def silences(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    form = SilenceForm(request.POST or None, initial={"matchers": request.GET.get("matchers", "")})
    if request.method == "POST":
        if not _can_operate(request):
            return HttpResponse("Silencing needs the operator role.", status=403)
        if form.is_valid():
            with transaction.atomic():
                silence = Silence.objects.create(
                    matchers=form.cleaned_data["parsed_matchers"], starts_at=form.cleaned_data["starts_at"],
                    ends_at=form.cleaned_data["ends_at"], comment=form.cleaned_data["comment"],
                    created_by=request.user.get_username(), author=_user(request),
                )
                audit.record(request.user, "silence.create", silence, None, silence.audit_state())
            messages.success(request, f"Silence {silence.pk} created until {silence.ends_at:%Y-%m-%d %H:%M} UTC.")
            return redirect("alert-silences")
    active_alerts = list(Alert.objects.active())
    rows = []
    for silence in Silence.objects.all()[:300]:
        status = silence.status(now)
        matched = [a for a in active_alerts if silence.matches(a.labels)] if status == "active" else []
        rows.append({"silence": silence, "status": status, "matched": matched})
    return render(request, "alerts/silences.html", {"form": form, "rows": rows})


@require_POST
@role_required(Role.OPERATOR)
def silence_expire(request: HttpRequest, pk: int) -> HttpResponse:
    with transaction.atomic():
        silence = get_object_or_404(Silence.objects.select_for_update(), pk=pk)
        before = silence.audit_state()
        silence.expire(timezone.now())
        audit.record(request.user, "silence.expire", silence, before, silence.audit_state())
    messages.success(request, f"Silence {silence.pk} expired.")
    return redirect("alert-silences")


def _user(request: HttpRequest) -> Any:
    """The signed-in user (role_required let only those in)."""
    return request.user if request.user.is_authenticated else None


def _can_operate(request: HttpRequest) -> bool:
    from controlplane.accounts.roles import role_of

    return role_of(request.user) >= Role.OPERATOR
