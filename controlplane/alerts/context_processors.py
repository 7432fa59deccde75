"""Template context: the critical alerts firing now, for the banner every
page shows. Silenced ones are left out: a silence is how an operator says
"I know"."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils import timezone

MAX_NAMED = 5


def critical_alerts(request: HttpRequest) -> dict[str, Any]:
    from controlplane.alerts.models import Alert, Silence

    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"critical_alerts": []}
    firing = list(Alert.objects.firing_critical().order_by("fired_at")[:200])
    if firing:
        silences = list(Silence.objects.active_at(timezone.now()))
        firing = [a for a in firing if not a.silenced_by(silences)]
    names = sorted({a.name for a in firing})
    return {"critical_alerts": firing, "critical_alert_names": names[:MAX_NAMED],
            "critical_alert_more": max(len(names) - MAX_NAMED, 0)}
