"""What the alert pages show: the active alerts (the alerts page's live
part), one alert, the rules, the silences, and the critical-alert banner
every page shows (``critical_alerts``, a template context processor). The
active alerts and the banner are pushed whenever an alert changes state
(``alerts.changed``).

Silenced alerts stay on the alerts page, marked; they are left out of the
banner: a silence is how an operator says "I know".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from controlplane.alerts.labels import Matcher
from controlplane.alerts.models import Alert, AlertRule, AlertTransition, Delivery, Silence

MAX_NAMED = 5  # alert names the banner spells out
MAX_FIRING = 200
ACTIVE_LIMIT = 500
HISTORY_LIMIT = 200


# ---- the banner on every page -----------------------------------------------------------
def critical_alerts(request: HttpRequest) -> dict[str, Any]:
    """Template context processor: the critical alerts firing now."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"critical_alerts": []}
    return banner_context()


def banner_context() -> dict[str, Any]:
    firing = list(Alert.objects.firing_critical().order_by("fired_at")[:MAX_FIRING])
    if firing:
        silences = list(Silence.objects.active_at(timezone.now()))
        firing = [a for a in firing if not a.silenced_by(silences)]
    names = sorted({a.name for a in firing})
    return {
        "critical_alerts": firing,
        "critical_alert_names": names[:MAX_NAMED],
        "critical_alert_more": max(len(names) - MAX_NAMED, 0),
    }


def render_banner_push() -> list[str]:
    """The banner and the count in the navigation, each an out-of-band swap."""
    context = {**banner_context(), "oob": True}
    return [
        render_to_string("alerts/partials/banner.html", context),
        render_to_string("alerts/partials/nav_count.html", context),
    ]


# ---- alerts -------------------------------------------------------------------------------
def active_context(params: Mapping[str, str]) -> dict[str, Any]:
    """Firing, pending and no-data alerts, filtered by ``?severity=`` and
    ``?silenced=hide``."""
    now = timezone.now()
    silences = list(Silence.objects.active_at(now))
    alerts = Alert.objects.active().select_related("rule").order_by("-state", "-fired_at", "-active_at")
    severity = params.get("severity", "")
    if severity:
        alerts = alerts.filter(labels__severity=severity)
    hide_silenced = params.get("silenced") == "hide"
    rows = []
    for alert in alerts[:ACTIVE_LIMIT]:
        silenced = alert.silenced_by(silences)
        if hide_silenced and silenced:
            continue
        rows.append(
            {
                "alert": alert,
                "silenced_by": silenced,
                "annotations": alert.live_annotations(),
                "silence_url": silence_url(alert),
            }
        )
    filters = urlencode({k: v for k, v in (("severity", severity), ("silenced", "hide" if hide_silenced else "")) if v})
    return {"rows": rows, "severity": severity, "now": now, "hide_silenced": hide_silenced, "filters": filters}


def render_active_push(params: Mapping[str, str], user_context: dict[str, Any]) -> str:
    return render_to_string("alerts/partials/active.html", {**active_context(params), **user_context, "oob": True})


def history() -> QuerySet[AlertTransition]:
    return AlertTransition.objects.select_related("alert").order_by("-at", "-id")[:HISTORY_LIMIT]


def silence_url(alert: Alert) -> str:
    """The silences page with a form that matches this alert exactly."""
    matchers = "\n".join(str(Matcher(k, "=", v)) for k, v in sorted(alert.labels.items()))
    return f"{reverse('alert-silences')}?{urlencode({'matchers': matchers})}"


def alert_context(alert: Alert) -> dict[str, Any]:
    silences = [s for s in Silence.objects.filter(ends_at__gt=timezone.now()) if s.matches(alert.labels)]
    deliveries = Delivery.objects.carrying(alert.fingerprint).select_related("receiver")[:50]
    return {
        "alert": alert,
        "annotations": alert.live_annotations(),
        "transitions": alert.transitions.all()[:200],
        "deliveries": deliveries,
        "silences": silences,
        "silence_url": silence_url(alert),
    }


# ---- rules and silences ------------------------------------------------------------------
def rules_context() -> dict[str, Any]:
    counts: dict[int, int] = {}
    for rule_id in Alert.objects.active().values_list("rule_id", flat=True):
        counts[rule_id] = counts.get(rule_id, 0) + 1
    return {"rows": [{"rule": rule, "num_active": counts.get(rule.pk, 0)} for rule in AlertRule.objects.all()]}


def silence_rows() -> list[dict[str, Any]]:
    now = timezone.now()
    active_alerts = list(Alert.objects.active())
    rows = []
    for silence in Silence.objects.all()[:300]:
        status = silence.status(now)
        matched = [a for a in active_alerts if silence.matches(a.labels)] if status == "active" else []
        rows.append({"silence": silence, "status": status, "matched": matched})
    return rows
