"""Alerting's tunables: settings.NAME, else the environment variable NAME,
else the defaults here (so the app needs no settings of its own to run)."""

from __future__ import annotations

from django.conf import settings

from controlplane.conf import setting


def eval_interval_seconds() -> float:
    return float(settings.ALERT_EVAL_INTERVAL)


def dispatch_interval_seconds() -> float:
    """How often notification groups are looked at: group_wait and
    group_interval are honoured to within this."""
    return float(setting("ALERT_DISPATCH_INTERVAL", min(5.0, eval_interval_seconds())))


def flap_window_seconds() -> float:
    return float(setting("ALERT_FLAP_WINDOW_SECONDS", 600.0))


def flap_threshold() -> int:
    return int(setting("ALERT_FLAP_THRESHOLD", 3))


def resolved_retention_seconds() -> float:
    """How long a resolved alert still counts for notifications (Prometheus
    keeps resolved alerts 15 minutes to report them as resolved)."""
    return float(setting("ALERT_RESOLVED_RETENTION_SECONDS", 15 * 60.0))


def event_ttl_seconds() -> float:
    """Events (notify_event) resolve by themselves after this."""
    return float(setting("ALERT_EVENT_TTL_SECONDS", 5 * 60.0))


def delivery_max_attempts() -> int:
    return int(setting("ALERT_DELIVERY_MAX_ATTEMPTS", 6))


def delivery_backoff_seconds(num_attempts: int) -> float:
    """Before attempt ``num_attempts + 1``: 2 s, 4 s, 8 s ... capped at 5 minutes."""
    base = float(setting("ALERT_DELIVERY_BACKOFF_SECONDS", 2.0))
    return float(min(base * (2 ** max(num_attempts - 1, 0)), 300.0))


def delivery_timeout_seconds() -> float:
    return float(setting("ALERT_DELIVERY_TIMEOUT_SECONDS", 10.0))


def forward_resend_seconds() -> float:
    """An external Alertmanager hears of every active alert at least this
    often (Prometheus's resend delay); a firing alert's endsAt is four of these ahead."""
    return float(setting("ALERT_FORWARD_RESEND_SECONDS", 60.0))


def external_url() -> str:
    return str(getattr(settings, "EXTERNAL_URL", "")).rstrip("/")
