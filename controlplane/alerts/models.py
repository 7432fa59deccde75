"""Alert rules, the alerts they make, where notifications go, and silences.

* ``AlertRule``: a figure over a window, compared with a threshold, per
  group (worker, pool, cohort or the whole fleet), with ``for``,
  ``keep_firing_for``, what no data counts as, severity, labels,
  annotations and an action (notify, or abort the rollout that owns the
  canary). ``full_clean()`` gives field-level errors (see ``validation``).
* ``Alert``: one label set's alert, identified by its fingerprint; its state
  is ``lifecycle.AlertState``. Rows appear when an alert first becomes active and
  stay, resolved, as history. ``AlertTransition``: every state change, with
  the value that caused it.
* ``Receiver`` (webhook, email, or an external Alertmanager to forward to),
  ``Route`` (matchers → receiver, with grouping and timing),
  ``NotificationGroup`` (Alertmanager's aggregation group and notification
  log entry in one row), ``Delivery`` (one notification and its attempts).
* ``Silence``: matchers and a time window; silenced alerts keep their state
  and show, marked, but are not notified.
* ``InboundAlert``: an Alertmanager webhook alert that acted on a rollout,
  unique by (fingerprint, startsAt) so that a redelivery acts once; its
  resolved notification sets ``status`` and ``ends_at``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connections, models, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane import audit, live
from controlplane.alerts import conf, lifecycle
from controlplane.alerts.annotations import render_annotations
from controlplane.alerts.choices import (
    ACTION_ABORT,
    ACTION_CHOICES,
    ACTION_LABEL,
    ACTION_NOTIFY,
    COMPARATOR_CHOICES,
    COMPARE_CHOICES,
    GROUP_BY_CHOICES,
    NO_DATA_CHOICES,
    SEVERITY_CHOICES,
    STATE_CHOICES,
)
from controlplane.alerts.labels import Matcher, coerce_matcher, matches_all
from controlplane.alerts.lifecycle import AlertState, NoData
from controlplane.alerts.validation import rule_errors


class AlertRule(audit.Audited, models.Model):
    audit_name = "alert_rule"

    name = models.CharField(
        max_length=100, unique=True, help_text="the alert's name (its alertname label), e.g. CanaryTTFTRegression"
    )
    key = models.SlugField(
        max_length=64,
        unique=True,
        null=True,
        blank=True,
        editable=False,
        help_text="set on the rules Chunkpilot ships, so they are found again; null for operators' own",
    )
    enabled = models.BooleanField(default=True)
    figure = models.CharField(
        max_length=64, help_text="a figure from the metrics registry, or worker_missing / profile_drift_seconds"
    )
    selector = models.JSONField(
        default=dict,
        blank=True,
        help_text='which data: {"pool": ..., "cohort": ..., "worker": ..., "labels": {worker labels}}',
    )
    group_by = models.CharField(
        max_length=16,
        choices=GROUP_BY_CHOICES,
        default="fleet",
        help_text="one alert per worker, pool, cohort, or one for the fleet",
    )
    window_seconds = models.FloatField(default=300.0, help_text="the figure's window")
    compare_to = models.CharField(max_length=16, choices=COMPARE_CHOICES, default="", blank=True)
    comparator = models.CharField(max_length=2, choices=COMPARATOR_CHOICES, default=">")
    threshold = models.FloatField()
    floor = models.FloatField(
        null=True,
        blank=True,
        help_text="with compare_to: the figure itself must also be past this (an absolute floor), else the "
        "condition does not hold",
    )
    min_requests_per_second = models.FloatField(
        null=True,
        blank=True,
        help_text="judge only groups serving at least this many requests/s over the window; an idle one "
        "counts as ok (an idle engine's memory peak/mean is high by nature)",
    )
    for_seconds = models.FloatField(default=0.0, help_text="how long the condition must hold before firing")
    keep_firing_for_seconds = models.FloatField(
        default=0.0, help_text="how long it keeps firing after the condition clears"
    )
    no_data_state = models.CharField(max_length=16, choices=NO_DATA_CHOICES, default=NoData.NODATA.value)
    severity = models.CharField(max_length=16, choices=SEVERITY_CHOICES, default="warning")
    labels = models.JSONField(default=dict, blank=True, help_text="extra labels on every alert of the rule")
    summary = models.CharField(max_length=300, blank=True)
    description = models.TextField(blank=True)
    runbook_url = models.URLField(max_length=500, blank=True)
    dashboard_url = models.CharField(max_length=500, blank=True, help_text="absolute, or a path of this UI")
    action = models.CharField(max_length=16, choices=ACTION_CHOICES, default=ACTION_NOTIFY)

    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    last_evaluated_at = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="the evaluation tick that last took this rule"
    )
    last_error = models.CharField(max_length=500, blank=True, editable=False)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["enabled", "last_evaluated_at"], name="alertrule_due")]

    def __str__(self) -> str:
        return self.name

    def set_enabled(self, enabled: bool, actor: audit.Actor, *, now: datetime | None = None) -> None:
        """Switch the rule on or off, audited as ``alert_rule.update`` with just
        that change (the UI's toggle; the API's PATCH is a whole update)."""
        now = now or timezone.now()
        with transaction.atomic():
            before = {"enabled": self.enabled}
            self.enabled, self.updated_at = enabled, now
            self.save(update_fields=["enabled", "updated_at"])
            audit.record(actor, "alert_rule.update", self, before, {"enabled": enabled}, time=now)

    def clean(self) -> None:
        errors = rule_errors(self)
        if errors:
            from django.core.exceptions import ValidationError

            raise ValidationError(errors)

    def spec(self) -> lifecycle.Spec:
        return lifecycle.Spec(
            for_seconds=self.for_seconds,
            keep_firing_for_seconds=self.keep_firing_for_seconds,
            no_data=NoData(self.no_data_state),
            flap_window_seconds=conf.ALERT_FLAP_WINDOW_SECONDS.get(),
            flap_threshold=conf.ALERT_FLAP_THRESHOLD.get(),
        )

    def annotations(self) -> dict[str, str]:
        pairs = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": self.runbook_url,
            "dashboard_url": self.dashboard_url,
        }
        return {k: v for k, v in pairs.items() if v}

    def base_labels(self) -> dict[str, str]:
        """alertname, severity, the rule's own labels and the selector's fixed
        pool/cohort/worker: the labels every alert of the rule carries."""
        labels = {k: str(v) for k, v in (self.labels or {}).items()}
        for key in ("pool", "cohort", "worker"):
            if isinstance(self.selector, dict) and self.selector.get(key):
                labels[key] = str(self.selector[key])
        labels["severity"] = self.severity
        labels["alertname"] = self.name
        if self.action == ACTION_ABORT:
            labels[ACTION_LABEL] = ACTION_ABORT
        return labels

    def group_label_keys(self) -> set[str]:
        """The labels a group adds to the rule's own (see sources)."""
        if self.compare_to:
            return {"pool", "cohort"}
        return set() if self.group_by == "fleet" else {self.group_by}

    def describe_condition(self) -> str:
        window = lifecycle.format_duration(self.window_seconds)
        subject = f"{self.figure}[{window}]"
        if self.compare_to:
            subject = f"{subject} / {self.compare_to}"
        text = f"{subject} {self.comparator} {self.threshold:g}"
        if self.compare_to and self.floor is not None:
            text += f" and {self.figure} {self.comparator} {self.floor:g}"
        return text


class AlertQuerySet(models.QuerySet["Alert"]):
    def active(self) -> AlertQuerySet:
        return self.filter(state__gte=AlertState.NODATA)

    def firing_critical(self) -> AlertQuerySet:
        return self.filter(state=AlertState.FIRING, labels__severity="critical")


class Alert(models.Model):
    SOURCE_RULE = "rule"
    SOURCE_EVENT = "event"

    fingerprint = models.CharField(max_length=16, unique=True)
    # SET_NULL: a deleted rule's firing alerts still resolve, so receivers hear it.
    rule = models.ForeignKey(AlertRule, null=True, blank=True, on_delete=models.SET_NULL, related_name="alerts")
    source = models.CharField(
        max_length=8, default=SOURCE_RULE, choices=[(SOURCE_RULE, "rule"), (SOURCE_EVENT, "event")]
    )
    labels = models.JSONField(default=dict)
    annotations = models.JSONField(default=dict)
    state = models.PositiveSmallIntegerField(choices=STATE_CHOICES, default=AlertState.INACTIVE, db_index=True)
    value = models.FloatField(null=True, blank=True, help_text="the figure at the last evaluation")
    value_detail = models.CharField(max_length=300, blank=True, help_text="for ratio rules: both sides")
    active_at = models.DateTimeField(null=True, blank=True)
    fired_at = models.DateTimeField(null=True, blank=True, help_text="startsAt")
    resolved_at = models.DateTimeField(null=True, blank=True, help_text="endsAt")
    keep_firing_since = models.DateTimeField(null=True, blank=True)
    nodata_since = models.DateTimeField(null=True, blank=True)
    fired_times = models.JSONField(
        default=list, blank=True, help_text="epoch seconds it started firing, within the flap window"
    )
    flapping = models.BooleanField(default=False)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="events: when they resolve by themselves")
    state_changed_at = models.DateTimeField(default=timezone.now, db_index=True)
    last_evaluated_at = models.DateTimeField(null=True, blank=True)

    # Notification bookkeeping.
    last_notified_at = models.DateTimeField(null=True, blank=True)
    num_delivery_failures = models.PositiveIntegerField(default=0)
    last_delivery_error = models.CharField(max_length=500, blank=True)
    last_delivery_error_at = models.DateTimeField(null=True, blank=True)
    # Kill switch: which rollout it asked to abort, and when.
    abort_requested_at = models.DateTimeField(null=True, blank=True)
    abort_rollout_id = models.PositiveBigIntegerField(null=True, blank=True)

    objects = AlertQuerySet.as_manager()

    class Meta:
        ordering = ["-state", "-state_changed_at"]

    def __str__(self) -> str:
        return f"{self.name} {self.fingerprint}"

    @property
    def name(self) -> str:
        return str(self.labels.get("alertname", ""))

    @property
    def severity(self) -> str:
        return str(self.labels.get("severity", ""))

    @property
    def state_label(self) -> str:
        return AlertState(self.state).label

    @property
    def is_active(self) -> bool:
        return AlertState(self.state).is_active

    def progress(self) -> lifecycle.Progress:
        return lifecycle.Progress(
            state=AlertState(self.state),
            value=self.value,
            active_at=self.active_at,
            fired_at=self.fired_at,
            resolved_at=self.resolved_at,
            keep_firing_since=self.keep_firing_since,
            nodata_since=self.nodata_since,
            fired_times=tuple(datetime.fromtimestamp(t, tz=UTC) for t in self.fired_times or ()),
        )

    def take(self, s: lifecycle.Progress) -> None:
        self.state = int(s.state)
        self.value = s.value
        self.active_at = s.active_at
        self.fired_at = s.fired_at
        self.resolved_at = s.resolved_at
        self.keep_firing_since = s.keep_firing_since
        self.nodata_since = s.nodata_since
        self.fired_times = [t.timestamp() for t in s.fired_times]

    def live_annotations(self) -> dict[str, str]:
        """The annotations as of the last evaluation: a rule's templates
        rendered with the current value (stored ``annotations`` are as of the
        last transition, so that a steady cycle writes two numbers, not
        JSON); an event's as it was sent."""
        if self.rule_id is None or self.rule is None:
            return dict(self.annotations)
        return render_annotations(
            self.rule.annotations(), self.labels, self.value, self.value_detail, AlertState(self.state).is_active
        )

    def starts_at(self) -> datetime:
        return self.fired_at or self.active_at or self.state_changed_at

    def silenced_by(self, silences: list[Silence]) -> list[Silence]:
        return [s for s in silences if s.matches(self.labels)]


class AlertTransition(models.Model):
    """One state change of one alert, with the value that caused it. The
    unique key is the backstop of idempotent evaluation: the same change of
    the same alert at the same evaluation tick is one row, however many
    evaluators computed it."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="transitions")
    fingerprint = models.CharField(max_length=16)
    rule = models.ForeignKey(AlertRule, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    from_state = models.PositiveSmallIntegerField(choices=STATE_CHOICES)
    to_state = models.PositiveSmallIntegerField(choices=STATE_CHOICES)
    value = models.FloatField(null=True, blank=True)
    reason = models.CharField(max_length=200, blank=True)
    at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["fingerprint", "to_state", "at"], name="alert_transition_once_per_tick")
        ]

    def __str__(self) -> str:
        return f"{self.fingerprint} {AlertState(self.from_state).label}→{AlertState(self.to_state).label} at {self.at}"

    @staticmethod
    def record(transitions: list[AlertTransition]) -> list[AlertTransition]:
        """Store state changes (a copy another evaluator already stored is
        dropped by the unique key) and tell live pages, after commit, that
        these alerts changed: every state change is saved here."""
        if transitions:
            AlertTransition.objects.bulk_create(transitions, ignore_conflicts=True)
            live.publish(live.Event.ALERTS_CHANGED, alert_ids=sorted({t.alert_id for t in transitions}))
        return transitions

    @property
    def from_label(self) -> str:
        return AlertState(self.from_state).label

    @property
    def to_label(self) -> str:
        return AlertState(self.to_state).label


class Receiver(audit.Audited, models.Model):
    audit_name = "alert_receiver"

    KIND_WEBHOOK = "webhook"
    KIND_EMAIL = "email"
    KIND_ALERTMANAGER = "alertmanager"
    KIND_CHOICES = [
        (KIND_WEBHOOK, "webhook (Alertmanager's v4 payload)"),
        (KIND_EMAIL, "email"),
        (KIND_ALERTMANAGER, "external Alertmanager: every alert is forwarded to its /api/v2/alerts, unrouted"),
    ]

    name = models.SlugField(max_length=100, unique=True)
    kind = models.CharField(max_length=16, choices=KIND_CHOICES)
    url = models.URLField(max_length=500, blank=True, help_text="webhook URL, or the Alertmanager's base URL")
    bearer_token = models.CharField(max_length=500, blank=True, help_text="sent as Authorization: Bearer …")
    emails = models.JSONField(default=list, blank=True, help_text="email: the recipients")
    send_resolved = models.BooleanField(default=True)
    max_alerts = models.PositiveIntegerField(
        default=0, help_text="webhook: at most this many alerts per message; 0: all"
    )
    is_default = models.BooleanField(default=False, help_text="takes the alerts that no route takes")
    enabled = models.BooleanField(default=True)
    last_forwarded_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def audit_state(self) -> dict[str, Any]:
        return audit.snapshot(self, fields=[f.name for f in self._meta.concrete_fields if f.name != "bearer_token"])


class Route(audit.Audited, models.Model):
    audit_name = "alert_route"

    position = models.PositiveIntegerField(default=0, help_text="routes are tried in this order")
    matchers = models.JSONField(
        default=list, blank=True, help_text='e.g. ["severity=\\"critical\\"", "pool=~\\"gpu-.*\\""]'
    )
    receiver = models.ForeignKey(Receiver, on_delete=models.CASCADE, related_name="routes")
    group_by = models.JSONField(default=list, blank=True, help_text='label names; ["..."]: every label; []: alertname')
    group_wait_seconds = models.FloatField(default=30.0)
    group_interval_seconds = models.FloatField(default=300.0)
    repeat_interval_seconds = models.FloatField(default=4 * 3600.0)
    continue_matching = models.BooleanField(default=False, help_text="after a match, try the routes below too")

    class Meta:
        ordering = ["position", "id"]

    def __str__(self) -> str:
        return f"{self.position}: {' '.join(str(m) for m in self.parsed_matchers()) or '(all)'} → {self.receiver}"

    def parsed_matchers(self) -> list[Matcher]:
        return [coerce_matcher(m) for m in self.matchers or []]


class NotificationGroup(models.Model):
    """Alertmanager's aggregation group for one receiver and group key, and
    its notification log entry: what the receiver was last told."""

    receiver = models.ForeignKey(Receiver, on_delete=models.CASCADE, related_name="groups")
    group_key = models.CharField(max_length=500)
    group_labels = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    next_flush_at = models.DateTimeField(db_index=True)
    last_notified_at = models.DateTimeField(null=True, blank=True)
    notified_firing = models.JSONField(default=list, blank=True)
    notified_resolved = models.JSONField(default=list, blank=True)
    in_flight = models.ForeignKey("Delivery", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["receiver", "group_key"], name="alert_group_once")]

    def __str__(self) -> str:
        return f"{self.receiver}: {self.group_key}"


class DeliveryQuerySet(models.QuerySet["Delivery"]):
    def carrying(self, fingerprint: str) -> DeliveryQuerySet:
        """The deliveries that carried the alert with ``fingerprint``. JSON
        containment where the database has it (PostgreSQL); SQLite has no
        ``contains`` on JSON, so there the stored JSON text must hold the
        quoted fingerprint (a fingerprint is hex: nothing to escape, and the
        quotes keep one from matching a longer one)."""
        if connections[self.db].features.supports_json_field_contains:
            return self.filter(fingerprints__contains=[fingerprint])
        return self.filter(fingerprints__icontains=json.dumps(fingerprint))


class Delivery(models.Model):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"
    STATUS_CHOICES = [(PENDING, PENDING), (SENT, SENT), (FAILED, FAILED)]

    receiver = models.ForeignKey(Receiver, on_delete=models.CASCADE, related_name="deliveries")
    group = models.ForeignKey(
        NotificationGroup, null=True, blank=True, on_delete=models.SET_NULL, related_name="deliveries"
    )
    reason = models.CharField(max_length=32, blank=True, help_text="why it was sent: first notification, repeat, ...")
    payload = models.JSONField()
    fingerprints = models.JSONField(default=list, help_text="the alerts it carries")
    firing = models.JSONField(default=list)
    resolved = models.JSONField(default=list)
    status = models.CharField(max_length=8, choices=STATUS_CHOICES, default=PENDING, db_index=True)
    num_attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(db_index=True)
    last_error = models.CharField(max_length=500, blank=True)
    attempts = models.JSONField(default=list, blank=True, help_text="[{at, error}] of every attempt")
    created_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)

    objects = DeliveryQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.receiver} {self.reason} {self.status}"


class SilenceQuerySet(models.QuerySet["Silence"]):
    def active_at(self, now: datetime) -> SilenceQuerySet:
        return self.filter(starts_at__lte=now, ends_at__gt=now)


class Silence(audit.Audited, models.Model):
    audit_name = "silence"

    matchers = models.JSONField(help_text="Alertmanager's shape: [{name, value, isRegex, isEqual}]")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_by = models.CharField(max_length=150, help_text="the author")
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    comment = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = SilenceQuerySet.as_manager()

    class Meta:
        ordering = ["-ends_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(ends_at__gte=models.F("starts_at")), name="silence_ends_after_start")
        ]

    def __str__(self) -> str:
        return f"silence {self.pk}: {' '.join(str(m) for m in self.parsed_matchers())}"

    def parsed_matchers(self) -> list[Matcher]:
        return [coerce_matcher(m) for m in self.matchers or []]

    def matches(self, labels: dict[str, str]) -> bool:
        matchers = getattr(self, "_parsed", None)
        if matchers is None:
            matchers = self._parsed = self.parsed_matchers()
        return matches_all(matchers, labels)

    def status(self, now: datetime | None = None) -> str:
        """Alertmanager's: pending, active or expired."""
        now = now or timezone.now()
        if now < self.starts_at:
            return "pending"
        return "active" if now < self.ends_at else "expired"

    def save(self, *args: Any, **kwargs: Any) -> None:
        super().save(*args, **kwargs)
        # A silence changes what the alerts page and every page's banner show.
        live.publish(live.Event.ALERTS_CHANGED, alert_ids=[])

    def expire(self, now: datetime) -> None:
        """End it now (Alertmanager's DELETE): an active one ends now, a
        pending one never starts."""
        if self.starts_at > now:
            self.starts_at = now
        self.ends_at = min(self.ends_at, now)
        self.updated_at = now
        self.save(update_fields=["starts_at", "ends_at", "updated_at"])

    def expire_by(self, actor: audit.Actor, now: datetime | None = None) -> None:
        """``expire``, audited as ``silence.expire`` (the API's DELETE and the UI's button)."""
        now = now or timezone.now()
        with self.changing(actor, "expire", now=now):
            self.expire(now)

    def audit_state(self) -> dict[str, Any]:
        return {
            "matchers": self.matchers,
            "starts_at": self.starts_at.isoformat(),
            "ends_at": self.ends_at.isoformat(),
            "created_by": self.created_by,
            "comment": self.comment,
        }


class InboundAlert(models.Model):
    """An alert received from an Alertmanager webhook that asked for an action."""

    fingerprint = models.CharField(max_length=64)
    starts_at = models.DateTimeField()
    status = models.CharField(max_length=16)
    labels = models.JSONField(default=dict)
    annotations = models.JSONField(default=dict)
    receiver = models.CharField(max_length=200, blank=True)
    group_key = models.CharField(max_length=500, blank=True)
    received_at = models.DateTimeField()
    outcome = models.CharField(max_length=300, blank=True)
    ends_at = models.DateTimeField(null=True, blank=True)  # from the resolved notification
    resolved_received_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-received_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["fingerprint", "starts_at"], name="inbound_alert_once")]

    def __str__(self) -> str:
        return f"{self.labels.get('alertname', '')} {self.fingerprint} {self.starts_at:%Y-%m-%d %H:%M:%S}"
