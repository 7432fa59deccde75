"""Notifications: events from other apps, the dispatcher, and delivery.

    from controlplane.alerts.notify import notify_event

    notify_event("RolloutAborted", labels={"rollout": "12", "pool": "gpu-a"},
                 summary="Rollout 12 aborted: canary TTFT P99 1.4x baseline", severity="critical")

``dispatch(now)`` is Alertmanager's dispatcher and notification pipeline
over the stored alerts (see ``routing`` for the rules it follows): it sorts
the notifiable alerts (firing, no data, and resolved within the retention)
less the silenced ones into groups per route, and for each group due a look
decides from what the receiver was last told whether to notify. A
notification is a ``Delivery`` row; ``deliver(id)`` sends it, and on
failure records the error on the delivery and on its alerts and schedules
the next attempt with exponential backoff. A group's notification log
(what the receiver was told) moves only when a delivery succeeds, so a
receiver that was down hears the news at the next look after it is back.

``alertmanager`` receivers are not routed: like a Prometheus server, the
dispatcher forwards every alert to them whenever one changed, and at least
every ``forward_resend_seconds``, silenced or not (they have their own
silences).

Concurrency: ``dispatch`` runs in one transaction that first locks the
receivers, so two dispatchers take turns and the second finds the groups
already moved on; ``deliver`` claims a delivery with a conditional update
(a lease), so two workers never send the same one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.alerts import conf, routing
from controlplane.alerts.labels import fingerprint
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import (
    Alert,
    AlertTransition,
    Delivery,
    NotificationGroup,
    Receiver,
    Route,
    Silence,
)
from controlplane.alerts.receivers import DeliveryError, channel
from controlplane.alerts.routing import OutAlert, RouteSpec

log = logging.getLogger(__name__)
EVENT_LABEL = "chunkpilot_event"


# ---- events from other apps ----------------------------------------------------------


def notify_event(
    event: str | None = None,
    *,
    labels: Mapping[str, str],
    summary: str = "",
    description: str = "",
    severity: str | None = None,
    dashboard_url: str = "",
    annotations: Mapping[str, str] | None = None,
    ttl_seconds: float | None = None,
    now: datetime | None = None,
) -> Alert:
    """Send a one-off notice through alert routing and delivery, e.g. when a
    rollout aborts, pauses or completes.

    ``event``       the alert name, CamelCase: "RolloutAborted",
                    "RolloutPaused", "RolloutCompleted". May be left out when
                    ``labels`` carries ``alertname``.
    ``labels``      what the event is about, as strings: {"rollout": "12",
                    "pool": "gpu-a"}. ``alertname`` (= event), ``severity``
                    and ``chunkpilot_event="true"`` are added; routes and
                    silences match on all of them.
    ``summary``, ``description``, ``dashboard_url``  the annotations; or
                    pass them (and any others) as ``annotations``.
    ``severity``    info, warning or critical (critical shows the banner);
                    default ``labels["severity"]``, else info.
    ``ttl_seconds`` the notice fires now and resolves by itself after this
                    (default ALERT_EVENT_TTL_SECONDS, 5 minutes), which
                    sends the resolved notice to receivers that want them.
    ``now``         the caller's clock.

    Both ``notify_event("RolloutAborted", labels={...}, summary="...")`` and
    ``notify_event(labels={"alertname": ..., "severity": ..., ...},
    annotations={"summary": ..., ...})`` work.

    The event's identity is its label set: calling again with the same
    labels while it still fires refreshes it (new annotations, new expiry)
    without a second notification, so a reconciler may call it every tick.
    Give occurrences that must each notify a distinguishing label (e.g.
    ``step``). Safe inside the caller's transaction: the dispatcher is
    woken on commit. Returns the alert row.
    """
    now = now or timezone.now()
    ttl = conf.ALERT_EVENT_TTL_SECONDS.get() if ttl_seconds is None else float(ttl_seconds)
    full = {str(k): str(v) for k, v in labels.items()}
    name = event or full.get("alertname")
    if not name:
        raise ValueError("an event needs a name: pass event or labels['alertname']")
    full.update({"alertname": name, "severity": severity or full.get("severity") or "info", EVENT_LABEL: "true"})
    fp = fingerprint(full)
    notes = {str(k): str(v) for k, v in (annotations or {}).items() if v}
    for key, value in (("summary", summary), ("description", description), ("dashboard_url", dashboard_url)):
        if value:
            notes[key] = value
    summary = notes.get("summary", name)
    with transaction.atomic():
        alert = Alert.objects.select_for_update().filter(fingerprint=fp).first()
        previous = AlertState(alert.state) if alert is not None else AlertState.INACTIVE
        if alert is None:
            alert = Alert(fingerprint=fp, source=Alert.SOURCE_EVENT, labels=full)
        alert.annotations = notes
        alert.expires_at = now + timedelta(seconds=ttl)
        if previous != AlertState.FIRING:
            alert.state = AlertState.FIRING
            alert.active_at = alert.fired_at = alert.state_changed_at = now
            alert.resolved_at = None
        alert.last_evaluated_at = now
        alert.save()
        if previous != AlertState.FIRING:
            AlertTransition.record(
                [
                    AlertTransition(
                        alert=alert,
                        fingerprint=fp,
                        from_state=previous,
                        to_state=AlertState.FIRING,
                        reason=f"event: {summary}"[:200],
                        at=now,
                    )
                ],
            )
            _wake_dispatcher()
    return alert


def _expire_events(now: datetime) -> int:
    """Events past their expiry resolve (each a conditional update)."""
    expired = 0
    for alert in Alert.objects.filter(source=Alert.SOURCE_EVENT, state=AlertState.FIRING, expires_at__lte=now):
        ended = alert.expires_at or now
        if Alert.objects.filter(pk=alert.pk, state=AlertState.FIRING, expires_at=alert.expires_at).update(
            state=AlertState.RESOLVED, resolved_at=ended, state_changed_at=now
        ):
            AlertTransition.record(
                [
                    AlertTransition(
                        alert=alert,
                        fingerprint=alert.fingerprint,
                        from_state=AlertState.FIRING,
                        to_state=AlertState.RESOLVED,
                        reason="event expired",
                        at=ended,
                    )
                ],
            )
            expired += 1
    return expired


def _wake_dispatcher() -> None:
    # Imported here: tasks.py imports this module.
    from controlplane.alerts import tasks

    tasks.enqueue_dispatch()


# ---- the dispatcher ------------------------------------------------------------------


def to_out(alert: Alert) -> OutAlert:
    state = AlertState(alert.state)
    annotations = alert.live_annotations()
    for key in ("dashboard_url", "runbook_url"):
        if annotations.get(key, "").startswith("/"):  # a page of this UI: absolute for the receiver
            annotations[key] = _external_url() + annotations[key]
    if state == AlertState.NODATA:
        annotations["nodata"] = "the figure has no data; the rule counts that as its own state"
    return OutAlert(
        fingerprint=alert.fingerprint,
        labels=alert.labels,
        annotations=annotations,
        status="firing" if state.is_notified else "resolved",
        starts_at=alert.starts_at(),
        ends_at=None if state.is_notified else (alert.resolved_at or alert.state_changed_at),
        generator_url=f"{_external_url()}/alerts/{alert.pk}/",
    )


def route_specs(receivers: Mapping[int, Receiver]) -> tuple[list[RouteSpec], list[RouteSpec]]:
    routes = []
    for route in Route.objects.all():
        receiver = receivers.get(route.receiver_id)
        if receiver is None or receiver.kind == Receiver.KIND_ALERTMANAGER:
            continue
        routes.append(
            RouteSpec(
                receiver=receiver.name,
                matchers=tuple(route.parsed_matchers()),
                group_by=tuple(route.group_by) or ("alertname",),
                group_wait_seconds=route.group_wait_seconds,
                group_interval_seconds=route.group_interval_seconds,
                repeat_interval_seconds=route.repeat_interval_seconds,
                continue_matching=route.continue_matching,
            )
        )
    roots = [
        RouteSpec(receiver=r.name, is_root=True)
        for r in receivers.values()
        if r.is_default and r.kind != Receiver.KIND_ALERTMANAGER
    ]
    return routes, roots


@dataclass
class DispatchResult:
    deliveries: list[int] = field(default_factory=list)  # to send now
    num_groups: int = 0
    num_silenced: int = 0
    num_events_expired: int = 0


def notifiable_alerts(now: datetime) -> list[Alert]:
    retention = now - timedelta(seconds=conf.ALERT_RESOLVED_RETENTION_SECONDS.get())
    return list(
        Alert.objects.filter(
            Q(state__in=[AlertState.FIRING, AlertState.NODATA])
            | Q(state=AlertState.RESOLVED, resolved_at__gte=retention)
        ).select_related("rule")
    )


def dispatch(now: datetime | None = None) -> DispatchResult:
    now = now or timezone.now()
    result = DispatchResult()
    result.num_events_expired = _expire_events(now)
    with transaction.atomic():
        receivers = {r.pk: r for r in Receiver.objects.select_for_update().filter(enabled=True).order_by("pk")}
        by_name = {r.name: r for r in receivers.values()}
        alerts = notifiable_alerts(now)
        silences = list(Silence.objects.active_at(now))
        audible = []
        for alert in alerts:
            if silences and alert.silenced_by(silences):
                result.num_silenced += 1
            else:
                audible.append(alert)
        routes, roots = route_specs(receivers)
        groups = routing.group_alerts(routes, roots, (to_out(a) for a in audible))
        result.num_groups = len(groups)
        result.deliveries += _flush_groups(groups, by_name, now)
        result.deliveries += _forward(receivers, alerts, now)
        # Deliveries due a retry whose task was lost (a worker died) go again.
        result.deliveries += list(
            Delivery.objects.filter(status=Delivery.PENDING, next_attempt_at__lte=now)
            .exclude(pk__in=result.deliveries)
            .values_list("pk", flat=True)
        )
    return result


def _flush_groups(
    groups: dict[tuple[str, str], routing.Group], receivers: Mapping[str, Receiver], now: datetime
) -> list[int]:
    rows = {(g.receiver_id, g.group_key): g for g in NotificationGroup.objects.select_related("in_flight")}
    out: list[int] = []
    seen: set[tuple[int, str]] = set()
    for (receiver_name, key), group in sorted(groups.items()):
        receiver = receivers[receiver_name]
        row = rows.get((receiver.pk, key))
        seen.add((receiver.pk, key))
        if row is None:
            if not group.firing:
                continue  # a group is born of a firing alert
            row = NotificationGroup.objects.create(
                receiver=receiver,
                group_key=key,
                group_labels=group.labels,
                created_at=now,
                next_flush_at=now + timedelta(seconds=group.route.group_wait_seconds),
            )
        if now < row.next_flush_at:
            continue
        if row.in_flight is not None and row.in_flight.status == Delivery.PENDING:
            continue  # still trying to tell the receiver the last news
        known = set(row.notified_firing) | set(row.notified_resolved)
        # Resolved alerts matter to a receiver that heard of them.
        alerts = [a for a in group.alerts if a.status == "firing" or a.fingerprint in known]
        firing = frozenset(a.fingerprint for a in alerts if a.status == "firing")
        resolved = frozenset(a.fingerprint for a in alerts if a.status == "resolved")
        last = None
        if row.last_notified_at is not None:
            last = routing.LastNotice(
                row.last_notified_at, frozenset(row.notified_firing), frozenset(row.notified_resolved)
            )
        reason = routing.needs_update(
            last,
            firing,
            resolved,
            now=now,
            send_resolved=receiver.send_resolved,
            repeat_interval_seconds=group.route.repeat_interval_seconds,
        )
        row.next_flush_at = now + timedelta(seconds=group.route.group_interval_seconds)
        fields = ["next_flush_at"]
        if reason != routing.Reason.NONE:
            shown = alerts if receiver.send_resolved else [a for a in alerts if a.status == "firing"]
            if not shown:
                # Nothing to say (all resolved, resolved notices off): only the log moves.
                row.last_notified_at, row.notified_firing, row.notified_resolved = now, [], sorted(resolved)
                fields += ["last_notified_at", "notified_firing", "notified_resolved"]
            else:
                message = routing.webhook_message(
                    receiver.name, key, group.labels, shown, _external_url(), receiver.max_alerts
                )
                delivery = Delivery.objects.create(
                    receiver=receiver,
                    group=row,
                    reason=reason.value,
                    payload=message,
                    fingerprints=[a.fingerprint for a in shown],
                    firing=sorted(firing),
                    resolved=sorted(resolved),
                    next_attempt_at=now,
                    created_at=now,
                )
                row.in_flight = delivery
                fields.append("in_flight")
                out.append(delivery.pk)
        row.save(update_fields=fields)
    # Groups with nothing left in them: forget those the receiver holds nothing of.
    stale = [
        r.pk
        for ident, r in rows.items()
        if ident not in seen
        and r.next_flush_at <= now
        and (r.in_flight is None or r.in_flight.status != Delivery.PENDING)
    ]
    if stale:
        NotificationGroup.objects.filter(pk__in=stale).delete()
    return out


def _forward(receivers: Mapping[int, Receiver], alerts: list[Alert], now: datetime) -> list[int]:
    """Every alert to each external Alertmanager, Prometheus-style."""
    forwarders = [r for r in receivers.values() if r.kind == Receiver.KIND_ALERTMANAGER]
    if not forwarders:
        return []
    resend = conf.ALERT_FORWARD_RESEND_SECONDS.get()
    ends_at = now + timedelta(seconds=4 * max(resend, conf.ALERT_EVAL_INTERVAL.get()))
    out = []
    for receiver in forwarders:
        last = receiver.last_forwarded_at
        due = last is None or any(a.state_changed_at > last for a in alerts) or (now - last).total_seconds() >= resend
        if not alerts or not due:
            continue
        body = [routing.postable(to_out(a), ends_at) for a in alerts]
        delivery = Delivery.objects.create(
            receiver=receiver,
            reason="forward",
            payload=body,
            fingerprints=[a.fingerprint for a in alerts],
            firing=sorted(a.fingerprint for a in alerts if AlertState(a.state).is_notified),
            resolved=sorted(a.fingerprint for a in alerts if a.state == AlertState.RESOLVED),
            next_attempt_at=now,
            created_at=now,
        )
        Receiver.objects.filter(pk=receiver.pk).update(last_forwarded_at=now)
        out.append(delivery.pk)
    return out


# ---- delivery ---------------------------------------------------------------------------


@dataclass
class Attempt:
    delivery_id: int
    sent: bool
    error: str = ""
    retry_in_seconds: float | None = None  # None: no more attempts (sent, or given up)


def deliver(delivery_id: int, now: datetime | None = None) -> Attempt | None:
    """Send one delivery if it is due. Returns what happened, or None when
    there was nothing to do (sent already, not due, or another worker holds it)."""
    now = now or timezone.now()
    lease = timedelta(seconds=conf.ALERT_DELIVERY_TIMEOUT_SECONDS.get() + 30)
    claimed = Delivery.objects.filter(pk=delivery_id, status=Delivery.PENDING, next_attempt_at__lte=now).update(
        next_attempt_at=now + lease, num_attempts=F("num_attempts") + 1
    )
    if not claimed:
        return None
    delivery = Delivery.objects.select_related("receiver", "group").get(pk=delivery_id)
    error = ""
    try:
        channel(delivery.receiver.kind)(delivery.receiver, delivery.payload)
    except DeliveryError as exc:
        error = str(exc) or type(exc).__name__
    except Exception as exc:  # a bug in a channel must not lose the notification
        log.exception("alert delivery %s crashed", delivery_id)
        error = f"{type(exc).__name__}: {exc}"
    return _record(delivery, now, error)


def _record(delivery: Delivery, done: datetime, error: str) -> Attempt:
    with transaction.atomic():
        delivery.attempts = [*delivery.attempts, {"at": done.isoformat(), "error": error}]
        alerts = Alert.objects.filter(fingerprint__in=delivery.fingerprints)
        if not error:
            delivery.status, delivery.sent_at, delivery.last_error = Delivery.SENT, done, ""
            delivery.save(update_fields=["status", "sent_at", "last_error", "attempts"])
            alerts.update(last_notified_at=done)
            group = delivery.group
            if group is not None:
                NotificationGroup.objects.filter(pk=group.pk).update(
                    last_notified_at=done,
                    notified_firing=delivery.firing,
                    notified_resolved=delivery.resolved,
                    in_flight=None,
                )
            return Attempt(delivery.pk, True)
        delivery.last_error = error[:500]
        alerts.update(
            num_delivery_failures=F("num_delivery_failures") + 1,
            last_delivery_error=f"{delivery.receiver.name}: {error}"[:500],
            last_delivery_error_at=done,
        )
        if delivery.num_attempts >= conf.ALERT_DELIVERY_MAX_ATTEMPTS.get():
            delivery.status = Delivery.FAILED
            delivery.save(update_fields=["status", "last_error", "attempts"])
            if delivery.group_id is not None:
                # The log did not move: the next look at the group tries afresh.
                NotificationGroup.objects.filter(pk=delivery.group_id, in_flight=delivery).update(in_flight=None)
            return Attempt(delivery.pk, False, error)
        wait = _backoff_seconds(delivery.num_attempts)
        delivery.next_attempt_at = done + timedelta(seconds=wait)
        delivery.save(update_fields=["last_error", "attempts", "next_attempt_at"])
        return Attempt(delivery.pk, False, error, retry_in_seconds=wait)


def _backoff_seconds(num_attempts: int) -> float:
    """Before attempt ``num_attempts + 1``: 2 s, 4 s, 8 s ... capped at 5 minutes."""
    base = conf.ALERT_DELIVERY_BACKOFF_SECONDS.get()
    return float(min(base * (2 ** max(num_attempts - 1, 0)), 300.0))


def _external_url() -> str:
    return str(settings.EXTERNAL_URL).rstrip("/")
