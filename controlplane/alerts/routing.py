"""Where an alert's notifications go, when, and in what shape: Alertmanager's
dispatcher, deduplication and webhook payload. Pure: no Django.

Routes. Alertmanager's tree, one level deep: an implicit root whose
children are the configured routes, tried in order; an alert takes the
first that matches, and the ones after it too while a matched route says
``continue``. An alert no route takes goes to the root, which sends to the
default receivers. A route's key is its matchers as Alertmanager prints
them, under the root's ``{}`` (``{}/{severity="critical"}``).

Groups. On a route, alerts with the same values of the route's
``group_by`` labels form one group, keyed ``<route key>:<group labels>``.
A new group waits ``group_wait`` before its first notification (so alerts
that start together arrive together), then is looked at every
``group_interval``; at each look ``needs_update`` (Alertmanager's
DedupStage) says whether to notify, from what the receiver was last told:
new firing alerts, alerts that resolved since, or ``repeat_interval``
passed with something still firing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, TypedDict

from controlplane.alerts.labels import LabelSet, Matcher, format_labels, matches_all

ROOT_KEY = "{}"
GROUP_BY_ALL = "..."
ZERO_TIME = "0001-01-01T00:00:00Z"  # endsAt of a firing alert in a webhook payload


@dataclass(frozen=True)
class RouteSpec:
    receiver: str
    matchers: tuple[Matcher, ...] = ()
    group_by: tuple[str, ...] = ("alertname",)  # ("...",): every label
    group_wait_seconds: float = 30.0
    group_interval_seconds: float = 300.0
    repeat_interval_seconds: float = 4 * 3600.0
    continue_matching: bool = False
    is_root: bool = False

    @property
    def key(self) -> str:
        if self.is_root:
            return ROOT_KEY
        return f"{ROOT_KEY}/{{{','.join(str(m) for m in sorted(self.matchers, key=str))}}}"

    def matches(self, labels: LabelSet) -> bool:
        return matches_all(self.matchers, labels)

    def group_labels(self, labels: LabelSet) -> dict[str, str]:
        if GROUP_BY_ALL in self.group_by:
            return dict(labels)
        return {name: labels[name] for name in self.group_by if name in labels}


def match_routes(routes: Sequence[RouteSpec], roots: Sequence[RouteSpec], labels: LabelSet) -> list[RouteSpec]:
    """The routes that take an alert with ``labels``: Alertmanager's
    depth-first match under a root that matches everything."""
    taken: list[RouteSpec] = []
    for route in routes:
        if route.matches(labels):
            taken.append(route)
            if not route.continue_matching:
                break
    return taken or list(roots)


def group_key(route: RouteSpec, group_labels: LabelSet) -> str:
    return f"{route.key}:{format_labels(group_labels)}"


# ---- deduplication: Alertmanager's DedupStage --------------------------------------------


class Reason(StrEnum):
    NONE = "none"
    FIRST = "first notification"
    NEW_ALERTS = "new alerts added"
    NEW_RESOLVED = "some alerts resolved"
    ALL_RESOLVED = "all alerts resolved"
    REPEAT = "repeat interval elapsed"


@dataclass(frozen=True)
class LastNotice:
    """What the receiver was last told about a group (Alertmanager's nflog entry)."""

    at: datetime
    firing: frozenset[str]
    resolved: frozenset[str]


def needs_update(
    last: LastNotice | None,
    firing: frozenset[str],
    resolved: frozenset[str],
    *,
    repeat_interval_seconds: float,
    send_resolved: bool,
    now: datetime,
) -> Reason:
    """Whether a group with these firing and resolved fingerprints needs a
    notification, and why."""
    if last is None or not last.firing:
        # Never told, or last told that all had resolved: only news of firing counts.
        return Reason.FIRST if firing else Reason.NONE
    if not firing <= last.firing:
        return Reason.NEW_ALERTS
    if not firing:
        # Everything resolved. Sent even without send_resolved, so that the
        # notification log forgets the firing set (Alertmanager does the same);
        # the payload then carries only resolved alerts.
        return Reason.ALL_RESOLVED
    if send_resolved and not resolved <= last.resolved:
        return Reason.NEW_RESOLVED
    if (now - last.at).total_seconds() >= repeat_interval_seconds:
        return Reason.REPEAT
    return Reason.NONE


# ---- payloads --------------------------------------------------------------------------


Status = Literal["firing", "resolved"]


@dataclass(frozen=True)
class OutAlert:
    """An alert as notifications carry it."""

    fingerprint: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    status: Status
    starts_at: datetime
    ends_at: datetime | None  # None while firing
    generator_url: str = ""


class WebhookAlert(TypedDict):
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    startsAt: str
    endsAt: str
    generatorURL: str
    fingerprint: str


class WebhookMessage(TypedDict):
    """Alertmanager's webhook body, version 4."""

    version: str
    groupKey: str
    truncatedAlerts: int
    status: str
    receiver: str
    groupLabels: dict[str, str]
    commonLabels: dict[str, str]
    commonAnnotations: dict[str, str]
    externalURL: str
    alerts: list[WebhookAlert]


class PostableAlert(TypedDict, total=False):
    """One element of Alertmanager's ``POST /api/v2/alerts`` body."""

    labels: dict[str, str]
    annotations: dict[str, str]
    startsAt: str
    endsAt: str
    generatorURL: str


def rfc3339(when: datetime | None) -> str:
    if when is None:
        return ZERO_TIME
    text = when.astimezone(UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def common(maps: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """The pairs every map has with the same value."""
    maps = list(maps)
    if not maps:
        return {}
    first = maps[0]
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in maps[1:])}


def order_alerts(alerts: Iterable[OutAlert]) -> list[OutAlert]:
    """Firing first, then by label set, so a payload reads the same each time."""
    return sorted(alerts, key=lambda a: (a.status != "firing", format_labels(a.labels)))


def webhook_message(
    receiver: str,
    key: str,
    group_labels: Mapping[str, str],
    alerts: Sequence[OutAlert],
    external_url: str,
    max_alerts: int = 0,
) -> WebhookMessage:
    ordered = order_alerts(alerts)
    shown = ordered[:max_alerts] if max_alerts > 0 else ordered
    return WebhookMessage(
        version="4",
        groupKey=key,
        truncatedAlerts=len(ordered) - len(shown),
        status="firing" if any(a.status == "firing" for a in ordered) else "resolved",
        receiver=receiver,
        groupLabels=dict(group_labels),
        # Common labels and annotations are over all alerts, shown or not.
        commonLabels=common(a.labels for a in ordered),
        commonAnnotations=common(a.annotations for a in ordered),
        externalURL=external_url,
        alerts=[
            WebhookAlert(
                status=a.status,
                labels=dict(a.labels),
                annotations=dict(a.annotations),
                startsAt=rfc3339(a.starts_at),
                endsAt=rfc3339(a.ends_at),
                generatorURL=a.generator_url,
                fingerprint=a.fingerprint,
            )
            for a in shown
        ],
    )


def postable(alert: OutAlert, ends_at: datetime) -> PostableAlert:
    """For an external Alertmanager: a firing alert says until when it holds
    unless resent (Prometheus sends now + 4 × its resend interval)."""
    return PostableAlert(
        labels=dict(alert.labels),
        annotations=dict(alert.annotations),
        startsAt=rfc3339(alert.starts_at),
        endsAt=rfc3339(alert.ends_at if alert.ends_at is not None else ends_at),
        generatorURL=alert.generator_url,
    )


@dataclass
class Group:
    """One group's alerts at a dispatch, before deciding."""

    route: RouteSpec
    key: str
    labels: dict[str, str]
    alerts: list[OutAlert] = field(default_factory=list)

    @property
    def firing(self) -> frozenset[str]:
        return frozenset(a.fingerprint for a in self.alerts if a.status == "firing")

    @property
    def resolved(self) -> frozenset[str]:
        return frozenset(a.fingerprint for a in self.alerts if a.status == "resolved")


def group_alerts(
    routes: Sequence[RouteSpec], roots: Sequence[RouteSpec], alerts: Iterable[OutAlert]
) -> dict[tuple[str, str], Group]:
    """Alerts sorted into groups, keyed (receiver, group key)."""
    groups: dict[tuple[str, str], Group] = {}
    for alert in alerts:
        for route in match_routes(routes, roots, alert.labels):
            labels = route.group_labels(alert.labels)
            key = group_key(route, labels)
            group = groups.get((route.receiver, key))
            if group is None:
                group = groups[(route.receiver, key)] = Group(route, key, labels)
            group.alerts.append(alert)
    return groups


def summary_line(message: Mapping[str, Any]) -> str:
    """``[FIRING:2] TTFTRegression (pool="gpu-a")``: Alertmanager's default subject."""
    alerts = message["alerts"]
    num_firing = sum(1 for a in alerts if a["status"] == "firing")
    status = f"FIRING:{num_firing}" if message["status"] == "firing" else "RESOLVED"
    name = message["commonLabels"].get("alertname", "")
    extra = {k: v for k, v in message["groupLabels"].items() if k != "alertname"}
    tail = f" ({' '.join(f'{k}={v}' for k, v in sorted(extra.items()))})" if extra else ""
    return f"[{status}] {name}{tail}".strip()
