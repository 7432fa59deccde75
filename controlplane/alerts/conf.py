"""Alerting's tunables (``controlplane.conf``: settings, else environment, else these)."""

from __future__ import annotations

from django.conf import settings

from controlplane.conf import Tunable

ALERT_EVAL_INTERVAL = Tunable("ALERT_EVAL_INTERVAL", 15.0, "seconds between alert-rule evaluations")
ALERT_DISPATCH_INTERVAL = Tunable(
    "ALERT_DISPATCH_INTERVAL",
    lambda: min(5.0, ALERT_EVAL_INTERVAL.get()),
    "how often notification groups are looked at: group_wait and group_interval are honoured to within this",
    kind=float,
    shown_default="min(5, `ALERT_EVAL_INTERVAL`)",
)
ALERT_FLAP_WINDOW_SECONDS = Tunable(
    "ALERT_FLAP_WINDOW_SECONDS",
    600.0,
    "an alert that started firing `ALERT_FLAP_THRESHOLD` times within this is flapping",
)
ALERT_FLAP_THRESHOLD = Tunable("ALERT_FLAP_THRESHOLD", 3, "... and does not resolve until those firings age out")
ALERT_RESOLVED_RETENTION_SECONDS = Tunable(
    "ALERT_RESOLVED_RETENTION_SECONDS",
    15 * 60.0,
    "how long a resolved alert still counts for notifications (Prometheus keeps resolved alerts 15 minutes)",
)
ALERT_EVENT_TTL_SECONDS = Tunable(
    "ALERT_EVENT_TTL_SECONDS", 5 * 60.0, "events (`notify_event`) resolve by themselves after this"
)
ALERT_DELIVERY_MAX_ATTEMPTS = Tunable(
    "ALERT_DELIVERY_MAX_ATTEMPTS", 6, "attempts per notification before it is given up"
)
ALERT_DELIVERY_BACKOFF_SECONDS = Tunable(
    "ALERT_DELIVERY_BACKOFF_SECONDS", 2.0, "wait before the second attempt, doubling after each (at most 5 minutes)"
)
ALERT_DELIVERY_TIMEOUT_SECONDS = Tunable("ALERT_DELIVERY_TIMEOUT_SECONDS", 10.0, "one delivery's HTTP timeout")
ALERT_FORWARD_RESEND_SECONDS = Tunable(
    "ALERT_FORWARD_RESEND_SECONDS",
    60.0,
    "an external Alertmanager hears of every active alert at least this often; a firing alert's endsAt is four "
    "of these ahead",
)
ALERT_HISTORY_RETENTION_DAYS = Tunable(
    "ALERT_HISTORY_RETENTION_DAYS", 30.0, "resolved alerts, transitions and inbound webhook records are kept this long"
)
ALERT_DELIVERY_RETENTION_DAYS = Tunable("ALERT_DELIVERY_RETENTION_DAYS", 7.0, "finished deliveries are kept this long")
ALERT_EMAIL_FROM = Tunable(
    "ALERT_EMAIL_FROM",
    lambda: str(settings.DEFAULT_FROM_EMAIL),
    "the sender of alert e-mail",
    kind=str,
    shown_default="Django's `DEFAULT_FROM_EMAIL`",
)
