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

After the commit: firing ``abort_rollout`` alerts pull the kill switch
(``killswitch.pull_all``), and the notification dispatcher is woken.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane import audit
from controlplane.alerts import conf, engine, sources
from controlplane.alerts.engine import State
from controlplane.alerts.labels import fingerprint
from controlplane.alerts.models import Alert, AlertRule, AlertTransition

log = logging.getLogger(__name__)
ACTOR = "system:alerts"
ALERT_FIELDS = [
    "labels", "annotations", "state", "value", "active_at", "fired_at", "resolved_at", "keep_firing_since",
    "nodata_since", "fired_times", "flapping", "state_changed_at", "last_evaluated_at",
]
_TEMPLATE = re.compile(r"\{\{\s*\$(value|labels\.([a-zA-Z_][a-zA-Z0-9_]*))\s*\}\}")


@dataclass
class CycleResult:
    tick: datetime
    num_rules: int = 0
    num_alerts_written: int = 0
    transitions: list[AlertTransition] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def tick_of(now: datetime, interval_seconds: float | None = None) -> datetime:
    interval = interval_seconds or conf.eval_interval_seconds()
    return datetime.fromtimestamp(math.floor(now.timestamp() / interval) * interval, tz=UTC)


def expand(text: str, labels: dict[str, str], value: float | None) -> str:
    """Prometheus's two template variables: ``{{ $value }}``, ``{{ $labels.x }}``."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) == "value":
            return "no data" if value is None else f"{value:.4g}"
        return labels.get(m.group(2), "")

    return _TEMPLATE.sub(one, text) if "{{" in text else text


def condition_of(rule: AlertRule, sample: sources.Sample) -> bool | None:
    if sample.value is None:
        return None
    holds = engine.compare(sample.value, rule.comparator, rule.threshold)
    if holds and rule.compare_to and rule.floor is not None:
        # A ratio alone would alert on 10 ms against 8 ms: the figure must also matter.
        holds = sample.raw is not None and engine.compare(sample.raw, rule.comparator, rule.floor)
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
    if result.transitions:
        _after_commit(result)
    result.seconds = time.perf_counter() - started
    return result


def _evaluate_rules(rules: list[AlertRule], tick: datetime, result: CycleResult) -> None:
    result.num_rules = len(rules)
    fleet = sources.Fleet(tick)
    samples = sources.sample_all([sources.RuleQuery.from_rule(r) for r in rules], tick, fleet)
    worker_names = {w[0] for w in fleet.workers}
    pool_names = {w[1] for w in fleet.workers if w[1]} | set(fleet.routes)

    # The rows that matter: every active alert of these rules, and any row of
    # a label set that now needs one (it may have a resolved past).
    rule_ids = [r.pk for r in rules]
    rows = {a.fingerprint: a for a in Alert.objects.filter(rule_id__in=rule_ids).filter(
        Q(state__gte=State.NODATA) | Q(nodata_since__isnull=False) | Q(keep_firing_since__isnull=False)
    )}
    plans: list[tuple[AlertRule, engine.Spec, list[tuple[dict[str, str], str, sources.Sample]]]] = []
    wanted: set[str] = set()
    for rule in rules:
        got = samples.get(rule.pk, [])
        if isinstance(got, Exception):
            rule.last_error = f"{type(got).__name__}: {got}"[:500]
            result.errors[rule.name] = rule.last_error
            continue
        rule.last_error = ""
        base = rule.base_labels()
        spec = rule.spec()
        planned = []
        for sample in got:
            labels = {**sample.labels, **base}
            fp = fingerprint(labels)
            planned.append((labels, fp, sample))
            if fp not in rows and (sample.value is None or condition_of(rule, sample)):
                wanted.add(fp)
        plans.append((rule, spec, planned))
    if wanted:
        rows.update({a.fingerprint: a for a in Alert.objects.filter(fingerprint__in=wanted)})

    created: list[Alert] = []
    changed: list[Alert] = []
    pending_transitions: list[tuple[Alert, engine.Transition, AlertRule]] = []
    for rule, spec, planned in plans:
        seen: set[str] = set()
        for labels, fp, sample in planned:
            seen.add(fp)
            _step_one(rule, spec, rows.get(fp), labels, fp, sample, condition_of(rule, sample), tick,
                      created, changed, pending_transitions)
        # Active alerts whose group is gone from the data.
        for fp, row in list(rows.items()):
            if row.rule_id != rule.pk or fp in seen or not (row.is_active or row.nodata_since or row.keep_firing_since):
                continue
            gone = (row.labels.get("worker") and row.labels["worker"] not in worker_names) or (
                row.labels.get("pool") and row.labels["pool"] not in pool_names and rule.figure in sources.FLEET_FIGURES
            )
            # A group that left the fleet resolves; one that merely went quiet has no data.
            sample = sources.Sample({}, None)
            _step_one(rule, spec, row, dict(row.labels), fp, sample, False if gone else None, tick,
                      created, changed, pending_transitions)

    # Write: new rows, changed rows, transitions, the rules' stamps.
    if created:
        Alert.objects.bulk_create(created)
        if any(a.pk is None for a in created):  # backends that return no ids
            ids = dict(Alert.objects.filter(fingerprint__in=[a.fingerprint for a in created]).values_list("fingerprint", "pk"))
            for a in created:
                a.pk = ids[a.fingerprint]
    if changed:
        Alert.objects.bulk_update(changed, ALERT_FIELDS, batch_size=500)
    result.num_alerts_written = len(created) + len(changed)
    transitions = [
        AlertTransition(alert_id=alert.pk, fingerprint=alert.fingerprint, rule_id=rule.pk,
                        from_state=int(t.from_state), to_state=int(t.to_state), value=t.value,
                        reason=t.reason[:200], at=t.at)
        for alert, t, rule in pending_transitions
    ]
    if transitions:
        AlertTransition.objects.bulk_create(transitions, ignore_conflicts=True)
        for alert, t, _ in pending_transitions:
            if t.to_state in (State.FIRING, State.RESOLVED, State.NODATA):
                audit.record(ACTOR, f"alert.{t.to_state.label}", alert,
                             {"state": t.from_state.label},
                             {"state": t.to_state.label, "value": t.value, "reason": t.reason,
                              "labels": alert.labels},
                             time=t.at)
    result.transitions = transitions
    for rule in rules:
        rule.last_evaluated_at = tick
    AlertRule.objects.bulk_update(rules, ["last_evaluated_at", "last_error"])


def _step_one(rule: AlertRule, spec: engine.Spec, row: Alert | None, labels: dict[str, str], fp: str,
              sample: sources.Sample, condition: bool | None, tick: datetime, created: list[Alert],
              changed: list[Alert], transitions: list[tuple[Alert, engine.Transition, AlertRule]]) -> None:
    before = row.engine_state() if row is not None else engine.AlertState()
    after, transition = engine.step(spec, before, condition, sample.value, tick)
    if row is None and after == engine.AlertState(value=after.value):
        return  # quiet and never alerted: nothing to remember
    if row is None:
        row = Alert(fingerprint=fp, rule=rule, source=Alert.SOURCE_RULE, labels=labels)
        created.append(row)
    else:
        if after == before and not after.state.is_active:
            return  # resolved or inactive, and staying so
        changed.append(row)
    row.rule_id = rule.pk
    row.labels = labels
    row.take(after)
    row.flapping = engine.is_flapping(after, spec, tick) and after.state == State.FIRING
    annotations = {k: expand(v, labels, sample.value) for k, v in rule.annotations().items()}
    if sample.detail:
        annotations["value_detail"] = sample.detail
    if after.state.is_active or transition is not None:
        annotations["value"] = "no data" if sample.value is None else f"{sample.value:.6g}"
    row.annotations = annotations
    row.last_evaluated_at = tick
    if transition is not None:
        row.state_changed_at = tick
        transitions.append((row, transition, rule))


def _after_commit(result: CycleResult) -> None:
    from controlplane.alerts import tasks

    tasks.enqueue_dispatch()


def preview(rule: AlertRule, now: datetime | None = None) -> list[dict[str, Any]]:
    """"Test now": the rule's current value per group, the labels its alert
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
        out.append({
            "labels": labels,
            "fingerprint": fingerprint(labels),
            "value": sample.value,
            "raw": sample.raw,
            "detail": sample.detail,
            "condition": "no data" if holds is None else ("holds" if holds else "clear"),
        })
    return out

