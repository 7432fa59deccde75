"""One evaluation cycle: every due rule's figure is read, each alert steps
its state machine, and the changes are stored with the values that caused
them.

Idempotence. A cycle evaluates at a *tick*: ``now`` floored to the
evaluation interval (Prometheus aligns its evaluation timestamps the same
way). In one transaction it locks the enabled rules not yet evaluated at
this tick (``SELECT ... FOR UPDATE SKIP LOCKED``), evaluates them, writes
alerts and transitions, and stamps the rules with the tick. A second
evaluator running at the same time skips the locked rules; one that runs
after the commit finds them stamped and does nothing. So two evaluators
make one transition. As a backstop, a transition is unique on
(fingerprint, new state, tick). On SQLite the write transaction is
IMMEDIATE, which serializes evaluators the same way.

Alert rows appear when an alert first needs remembering (pending, firing,
no data, or waiting out ``for`` without data) and are kept as history;
inactive label sets that never alerted cost nothing.

Rules switched off or deleted take their alerts with them: those resolve
at the next cycle, so receivers hear it. After the commit the notification
dispatcher is woken; the Celery task then pulls the kill switch for firing
``abort_rollout`` alerts (``killswitch.pull_all``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane import audit
from controlplane.alerts import bulk, conf, lifecycle, sources
from controlplane.alerts.annotations import render_annotations
from controlplane.alerts.labels import fingerprint
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, AlertRule, AlertTransition

log = logging.getLogger(__name__)
ACTOR = "system:alerts"
ALERT_FIELDS = [
    "labels",
    "annotations",
    "state",
    "value",
    "value_detail",
    "active_at",
    "fired_at",
    "resolved_at",
    "keep_firing_since",
    "nodata_since",
    "fired_times",
    "flapping",
    "state_changed_at",
    "last_evaluated_at",
]
# A steady cycle of an active alert moves only these: annotations are
# rendered again from them when read (Alert.live_annotations).
VALUE_FIELDS = ["value", "value_detail", "last_evaluated_at"]
AUDIT_MAX_LISTED = 100


@dataclass
class CycleResult:
    tick: datetime
    num_rules: int = 0
    num_alerts_written: int = 0
    transitions: list[AlertTransition] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    read_seconds: float = 0.0  # of which reading the figures


def tick_of(now: datetime, interval_seconds: float | None = None) -> datetime:
    interval = interval_seconds or conf.ALERT_EVAL_INTERVAL.get()
    return datetime.fromtimestamp(math.floor(now.timestamp() / interval) * interval, tz=UTC)


def condition_of(rule: AlertRule, sample: sources.Sample) -> bool | None:
    if sample.idle:
        return False  # too little load to judge: ok
    if sample.value is None:
        return None
    holds = lifecycle.compare(sample.value, rule.comparator, rule.threshold)
    if holds and rule.compare_to and rule.floor is not None:
        # A ratio alone would alert on 10 ms against 8 ms: the figure must also matter.
        holds = sample.raw is not None and lifecycle.compare(sample.raw, rule.comparator, rule.floor)
    return holds


def evaluate(now: datetime | None = None) -> CycleResult:
    """Evaluate every due rule at the tick of ``now``."""
    started = time.perf_counter()
    now = now or timezone.now()
    tick = tick_of(now)
    result = CycleResult(tick)
    with transaction.atomic():
        rules = list(
            AlertRule.objects.select_for_update(skip_locked=True)
            .filter(enabled=True)
            .filter(Q(last_evaluated_at__isnull=True) | Q(last_evaluated_at__lt=tick))
        )
        if rules:
            _evaluate_rules(rules, tick, result)
        _retire_orphans(tick, result)
    if result.transitions:
        _after_commit(result)
    result.seconds = time.perf_counter() - started
    return result


def _retire_orphans(tick: datetime, result: CycleResult) -> None:
    """Alerts of rules switched off or deleted end now: Prometheus drops a
    removed rule's alerts, and receivers hear they resolved."""
    orphans = list(
        Alert.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(Q(rule__enabled=False) | Q(rule__isnull=True, source=Alert.SOURCE_RULE))
        .filter(Q(state__gte=AlertState.NODATA) | Q(nodata_since__isnull=False) | Q(keep_firing_since__isnull=False))
        .select_related("rule")
    )
    if not orphans:
        return
    writes = _Writes()
    for row in orphans:
        reason = "the rule was switched off" if row.rule is not None else "the rule was deleted"
        _retire(row, reason, tick, writes, row.rule)
    bulk.update_rows(writes.changed, ALERT_FIELDS)
    result.num_alerts_written += len(writes.changed)
    result.transitions += _store_transitions(writes.transitions, tick)


def _retire(row: Alert, reason: str, tick: datetime, writes: _Writes, rule: AlertRule | None) -> None:
    """End an alert at once, whatever its timers: firing or no data resolve,
    pending goes back to inactive."""
    before = AlertState(row.state)
    after = AlertState.RESOLVED if before.is_notified else AlertState.INACTIVE
    row.state, row.active_at, row.keep_firing_since, row.nodata_since = int(after), None, None, None
    if after == AlertState.RESOLVED:
        row.resolved_at = tick
    row.flapping = False
    row.state_changed_at = row.last_evaluated_at = tick
    writes.changed.append(row)
    if before != after:
        writes.transitions.append(_Made(row, lifecycle.Transition(before, after, tick, row.value, reason), rule))


def _evaluate_rules(rules: list[AlertRule], tick: datetime, result: CycleResult) -> None:
    result.num_rules = len(rules)
    read_started = time.perf_counter()
    fleet = sources.Fleet(tick)
    samples = sources.sample_all([sources.RuleQuery.from_rule(r) for r in rules], tick, fleet)
    result.read_seconds = time.perf_counter() - read_started
    worker_names = {w.name for w in fleet.workers}
    pool_names = {w.pool for w in fleet.workers if w.pool} | set(fleet.routes)

    # The rows that matter: every active alert of these rules, and any row of
    # a label set that now needs one (it may have a resolved past).
    rule_ids = [r.pk for r in rules]
    rows = {
        a.fingerprint: a
        for a in Alert.objects.filter(rule_id__in=rule_ids).filter(
            Q(state__gte=AlertState.NODATA) | Q(nodata_since__isnull=False) | Q(keep_firing_since__isnull=False)
        )
    }
    plans: list[_Plan] = []
    wanted: set[str] = set()
    for rule in rules:
        got = samples.get(rule.pk, [])
        if isinstance(got, Exception):
            rule.last_error = f"{type(got).__name__}: {got}"[:500]
            result.errors[rule.name] = rule.last_error
            continue
        rule.last_error = ""
        base = tuple(sorted(rule.base_labels().items()))
        plan = _Plan(rule, rule.spec())
        for sample in got:
            fp, label_items = _identity(base, tuple(sample.labels.items()))
            condition = condition_of(rule, sample)
            plan.groups.append(_Group(dict(label_items), fp, sample, condition))
            if fp not in rows and (sample.value is None or condition):
                wanted.add(fp)
        plans.append(plan)
    if wanted:
        rows.update({a.fingerprint: a for a in Alert.objects.filter(fingerprint__in=wanted)})

    rows_by_rule: dict[int | None, list[Alert]] = {}
    for row in rows.values():
        rows_by_rule.setdefault(row.rule_id, []).append(row)
    writes = _Writes()
    for plan in plans:
        rule, spec = plan.rule, plan.spec
        seen: set[str] = set()
        for group in plan.groups:
            seen.add(group.fingerprint)
            _step_one(
                rule,
                spec,
                rows.get(group.fingerprint),
                group.labels,
                group.fingerprint,
                group.sample,
                group.condition,
                tick,
                writes,
            )
        # Active alerts whose group is gone from the data.
        base_labels, group_keys = rule.base_labels(), rule.group_label_keys()
        for row in rows_by_rule.get(rule.pk, []):
            fp = row.fingerprint
            if fp in seen or not (row.is_active or row.nodata_since or row.keep_firing_since):
                continue
            if set(row.labels) != set(base_labels) | group_keys or any(
                row.labels.get(k) != v for k, v in base_labels.items()
            ):
                # The rule was edited (labels, severity, grouping): this label set is no longer its.
                _retire(row, "the rule changed; its alerts carry other labels now", tick, writes, rule)
                continue
            gone = (row.labels.get("worker") and row.labels["worker"] not in worker_names) or (
                row.labels.get("pool") and row.labels["pool"] not in pool_names and rule.figure in sources.FLEET_FIGURES
            )
            # A group that left the fleet resolves; one that merely went quiet has no data.
            sample = sources.Sample({}, None)
            _step_one(rule, spec, row, dict(row.labels), fp, sample, False if gone else None, tick, writes)

    # Write: new rows, changed rows, transitions, the rules' stamps.
    created = writes.created
    if created:
        Alert.objects.bulk_create(created)
        if any(a.pk is None for a in created):  # backends that return no ids
            ids = dict(
                Alert.objects.filter(fingerprint__in=[a.fingerprint for a in created]).values_list("fingerprint", "pk")
            )
            for a in created:
                a.pk = ids[a.fingerprint]
    bulk.update_rows(writes.changed, ALERT_FIELDS)
    bulk.update_rows(writes.refreshed, VALUE_FIELDS)
    result.num_alerts_written = len(created) + len(writes.changed) + len(writes.refreshed)
    result.transitions = _store_transitions(writes.transitions, tick)
    for rule in rules:
        rule.last_evaluated_at = tick
    bulk.update_rows(rules, ["last_evaluated_at", "last_error"])


def _store_transitions(made: list[_Made], tick: datetime) -> list[AlertTransition]:
    transitions = [
        AlertTransition(
            alert_id=m.alert.pk,
            fingerprint=m.alert.fingerprint,
            rule_id=m.rule.pk if m.rule else None,
            from_state=int(m.transition.from_state),
            to_state=int(m.transition.to_state),
            value=m.transition.value,
            reason=m.transition.reason[:200],
            at=m.transition.at,
        )
        for m in made
    ]
    if transitions:
        AlertTransition.record(transitions)
        _audit(made, tick)
    return transitions


def _audit(transitions: list[_Made], tick: datetime) -> None:
    """One audit row per rule and outcome per cycle (firing, resolved, no
    data), listing the alerts: a storm of 500 alerts is one readable row,
    and one alert is a row that names it."""
    by_outcome: dict[tuple[int, AlertState], list[tuple[Alert, lifecycle.Transition]]] = {}
    rules: dict[int, AlertRule] = {}
    for made in transitions:
        alert, t, rule = made.alert, made.transition, made.rule
        if t.to_state in (AlertState.FIRING, AlertState.RESOLVED, AlertState.NODATA):
            by_outcome.setdefault((rule.pk if rule else 0, t.to_state), []).append((alert, t))
            if rule is not None:
                rules[rule.pk] = rule
    for (rule_id, state), items in sorted(by_outcome.items()):
        listed = [
            {
                "fingerprint": a.fingerprint,
                "labels": a.labels,
                "from": t.from_state.label,
                "value": t.value,
                "reason": t.reason,
            }
            for a, t in items[:AUDIT_MAX_LISTED]
        ]
        subject = rules.get(rule_id) or audit.Subject("alerts.alertrule", "", "(a deleted rule)")
        audit.record(
            ACTOR,
            f"alert.{state.label}",
            subject,
            None,
            {"state": state.label, "num_alerts": len(items), "alerts": listed},
            time=tick,
        )


@lru_cache(maxsize=65536)
def _identity(
    base: tuple[tuple[str, str], ...], group: tuple[tuple[str, str], ...]
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """An alert's fingerprint and label set from its rule's labels and its
    group's: the same every cycle, so worked out once (a rule's labels win,
    as in Prometheus)."""
    labels = {**dict(group), **dict(base)}
    return fingerprint(labels), tuple(sorted(labels.items()))


def _same_but_value(a: lifecycle.Progress, b: lifecycle.Progress) -> bool:
    return (a.state, a.active_at, a.fired_at, a.resolved_at, a.keep_firing_since, a.nodata_since, a.fired_times) == (
        b.state,
        b.active_at,
        b.fired_at,
        b.resolved_at,
        b.keep_firing_since,
        b.nodata_since,
        b.fired_times,
    )


@dataclass(frozen=True)
class _Group:
    """One label set a rule's query gave this cycle, and whether the condition holds (None: no data)."""

    labels: dict[str, str]
    fingerprint: str
    sample: sources.Sample
    condition: bool | None


@dataclass
class _Plan:
    """What a cycle steps for one rule."""

    rule: AlertRule
    spec: lifecycle.Spec
    groups: list[_Group] = field(default_factory=list)


@dataclass(frozen=True)
class _Made:
    """A transition made this cycle, with its alert and rule (None: the rule is gone)."""

    alert: Alert
    transition: lifecycle.Transition
    rule: AlertRule | None


@dataclass
class _Writes:
    created: list[Alert] = field(default_factory=list)
    changed: list[Alert] = field(default_factory=list)  # state or timers moved: every field
    refreshed: list[Alert] = field(default_factory=list)  # same state, new value: the value fields
    transitions: list[_Made] = field(default_factory=list)


def _step_one(
    rule: AlertRule,
    spec: lifecycle.Spec,
    row: Alert | None,
    labels: dict[str, str],
    fp: str,
    sample: sources.Sample,
    condition: bool | None,
    tick: datetime,
    writes: _Writes,
) -> None:
    if row is None and condition is False:
        return  # quiet and never alerted (most groups, most cycles): nothing to step or remember
    before = row.progress() if row is not None else lifecycle.Progress()
    after, transition = lifecycle.step(spec, before, condition, sample.value, tick)
    if row is None and after == lifecycle.Progress(value=after.value):
        return  # quiet and never alerted: nothing to remember
    if row is not None and after == before and not after.state.is_active:
        return  # resolved or inactive, and staying so
    flapping = lifecycle.is_flapping(after, spec, tick) and after.state == AlertState.FIRING

    if row is None:
        row = Alert(fingerprint=fp, rule=rule, source=Alert.SOURCE_RULE, labels=labels)
        writes.created.append(row)
    elif _same_but_value(after, before) and flapping == row.flapping and row.labels == labels:
        # The common case of an active alert: only its value moved, if that.
        if row.value == after.value and row.value_detail == sample.detail:
            return
        row.value, row.value_detail, row.last_evaluated_at = after.value, sample.detail, tick
        writes.refreshed.append(row)
        return
    else:
        writes.changed.append(row)
    row.rule_id = rule.pk
    row.labels = labels
    row.take(after)
    row.flapping = flapping
    row.value_detail = sample.detail
    row.annotations = render_annotations(
        rule.annotations(), labels, after.value, sample.detail, after.state.is_active or transition is not None
    )
    row.last_evaluated_at = tick
    if transition is not None:
        row.state_changed_at = tick
        writes.transitions.append(_Made(row, transition, rule))


def _after_commit(result: CycleResult) -> None:
    # Imported here: tasks.py imports this module.
    from controlplane.alerts import tasks

    tasks.enqueue_dispatch()


def preview(rule: AlertRule, now: datetime | None = None) -> list[dict[str, Any]]:
    """ "Test now": the rule's current value per group, the labels its alert
    would carry and whether the condition holds. Writes nothing."""
    now = now or timezone.now()
    query = sources.RuleQuery.from_rule(rule)
    query.rule_id = rule.pk or 0
    got = sources.sample_all([query], now)[query.rule_id]
    if isinstance(got, Exception):
        raise got
    base = rule.base_labels()
    out = []
    for sample in got:
        labels = {**sample.labels, **base}
        holds = condition_of(rule, sample)
        out.append(
            {
                "labels": labels,
                "fingerprint": fingerprint(labels),
                "value": sample.value,
                "raw": sample.raw,
                "detail": sample.detail,
                "condition": "no data" if holds is None else ("holds" if holds else "clear"),
            }
        )
    return out
