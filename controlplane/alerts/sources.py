"""What a rule's figure is worth now, per group: the alert's input.

Every figure of the metrics registry (``controlplane.metrics.figures``) is
read through ``metrics.query``; two more come from the fleet registry, since
they are states rather than measurements:

* ``worker_missing``: 1 for a worker that is unhealthy or offline (missed
  heartbeats), else 0; for a pool, cohort or the fleet, how many are.
* ``profile_drift_seconds``: how long a worker has not been running the
  revision it should; for a group, the longest.

One evaluation cycle reads each stored window once for all the rules that
use it (``reader``), so 200 rules cost as many reads as they have distinct
windows.

A value of None is no data. A rule's selector may also name worker labels
(``{"labels": {"zone": "a"}}``): then only those workers' groups count.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from controlplane.alerts.labels import Matcher, matches_all
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from controlplane.gateway.models import RoutingPool
from controlplane.metrics import figures, reader
from controlplane.metrics.query import NO_COHORT, NO_POOL

WORKER_MISSING = "worker_missing"
PROFILE_DRIFT = "profile_drift_seconds"
FLEET_GROUP_BY = ("fleet", "worker", "pool", "cohort")
# What a rule's min_requests_per_second is compared with, per group.
LOAD_FIGURE = "requests_per_second"


@dataclass(frozen=True)
class FleetFigure:
    name: str
    label: str
    unit: str
    description: str


FLEET_FIGURES: dict[str, FleetFigure] = {
    WORKER_MISSING: FleetFigure(
        WORKER_MISSING,
        "Workers missing",
        "workers",
        "Workers that missed heartbeats (unhealthy or offline): 1 or 0 per worker, the count per group.",
    ),
    PROFILE_DRIFT: FleetFigure(
        PROFILE_DRIFT,
        "Profile drift",
        "s",
        "How long a worker has not run the profile revision it should (0 when in step); the longest per group.",
    ),
}
SELECTOR_KEYS = ("pool", "cohort", "worker", "labels")


def figure_names() -> list[str]:
    return [*figures.FIGURES, *FLEET_FIGURES]


def figure_info(name: str) -> dict[str, str] | None:
    """Label, unit and description of a figure, or None if there is none by that name."""
    if name in FLEET_FIGURES:
        f = FLEET_FIGURES[name]
        return {"name": f.name, "label": f.label, "unit": f.unit, "description": f.description, "source": "fleet"}
    figure = figures.FIGURES.get(name)
    return figure.describe() if figure is not None else None


def group_by_choices(name: str) -> tuple[str, ...]:
    if name in FLEET_FIGURES:
        return FLEET_GROUP_BY
    figure = figures.FIGURES.get(name)
    if figure is None:
        return ()
    # length buckets are not places an alert can point at
    return tuple(g for g in figures.group_by_choices(figure) if g != "length_bucket")


@dataclass(frozen=True)
class Sample:
    """One group's value: the labels it adds to the alert, and the value."""

    labels: dict[str, str]
    value: float | None
    raw: float | None = None  # the figure itself, where ``value`` is a ratio to a peer
    detail: str = ""
    idle: bool = False  # below the rule's min_requests_per_second: not judged


@dataclass
class RuleQuery:
    """What one rule asks for (read off an ``AlertRule`` by ``from_rule``)."""

    rule_id: int
    figure: str
    window_seconds: float
    group_by: str
    selector: dict[str, str] = field(default_factory=dict)  # pool / cohort / worker
    worker_labels: dict[str, str] = field(default_factory=dict)
    compare_to: str = ""
    min_requests_per_second: float | None = None

    @classmethod
    def from_rule(cls, rule: Any) -> RuleQuery:
        selector = rule.selector if isinstance(rule.selector, dict) else {}
        return cls(
            rule_id=rule.pk,
            figure=rule.figure,
            window_seconds=float(rule.window_seconds),
            group_by=rule.group_by,
            selector={k: str(selector[k]) for k in ("pool", "cohort", "worker") if selector.get(k)},
            worker_labels={str(k): str(v) for k, v in (selector.get("labels") or {}).items()},
            compare_to=rule.compare_to or "",
            min_requests_per_second=getattr(rule, "min_requests_per_second", None),
        )


@dataclass(frozen=True)
class FleetWorker:
    name: str
    pool: str | None
    labels: dict[str, Any]
    state: int
    drift_since: datetime | None


class Fleet:
    """The fleet as alerting needs it, read once per cycle: each worker's
    pool, labels, whether it is missing and since when it drifts, and each
    pool's routing (table and role)."""

    def __init__(self, now: datetime):
        self.now = now
        self.workers = [
            FleetWorker(*row)
            for row in Worker.objects.values_list("name", "pool__name", "labels", "state", "drift_since")
        ]
        self.routes: dict[str, list[tuple[int, str]]] = defaultdict(list)  # pool → [(table, role)]
        self.tables: dict[int, dict[str, str]] = defaultdict(dict)  # table → role → pool
        for table_id, pool, role in RoutingPool.objects.values_list("table_id", "pool__name", "role"):
            self.routes[pool].append((table_id, role))
            self.tables[table_id][role] = pool

    def worker_labels(self) -> dict[str, dict[str, str]]:
        return {w.name: {str(k): str(v) for k, v in (w.labels or {}).items()} for w in self.workers}

    def role_of(self, pool: str | None) -> str:
        routes = self.routes.get(pool or "")
        return routes[0][1] if routes else ""

    def peer(self, pool: str, compare_to: str) -> str | None:
        """The pool ``pool`` is compared with: the table's baseline (else its
        stable), or its stable."""
        for table_id, _ in self.routes.get(pool, []):
            roles = self.tables[table_id]
            wanted = ("baseline", "stable") if compare_to == "baseline" else ("stable",)
            for role in wanted:
                if roles.get(role) and roles[role] != pool:
                    return roles[role]
        return None


def _group_labels(group_by: str, group: str) -> dict[str, str]:
    return {} if group_by == "fleet" else {group_by: group}


def _fleet_samples(q: RuleQuery, fleet: Fleet) -> list[Sample]:
    label_matchers = [Matcher(k, "=", v) for k, v in q.worker_labels.items()]
    per_group: dict[str, list[float]] = defaultdict(list)
    for worker in fleet.workers:
        name, pool, labels, state, drift_since = (
            worker.name,
            worker.pool,
            worker.labels,
            worker.state,
            worker.drift_since,
        )
        cohort = fleet.role_of(pool)
        if q.selector.get("worker") and q.selector["worker"] != name:
            continue
        if q.selector.get("pool") and q.selector["pool"] != pool:
            continue
        if q.selector.get("cohort") and q.selector["cohort"] != cohort:
            continue
        if label_matchers and not matches_all(label_matchers, {str(k): str(v) for k, v in (labels or {}).items()}):
            continue
        if q.figure == WORKER_MISSING:
            value = 1.0 if WorkerState(state).is_lost else 0.0
        else:
            value = 0.0 if drift_since is None else max((fleet.now - drift_since).total_seconds(), 0.0)
        group = {"fleet": "fleet", "worker": name, "pool": pool or NO_POOL, "cohort": cohort or NO_COHORT}[q.group_by]
        per_group[group].append(value)
    if not per_group and q.group_by == "fleet":
        # An empty fleet misses no worker and drifts nowhere: that is a value, not a gap.
        return [Sample({}, 0.0)]
    reduce = sum if q.figure == WORKER_MISSING else max
    return [Sample(_group_labels(q.group_by, g), float(reduce(values))) for g, values in sorted(per_group.items())]


def _key(q: RuleQuery, group_by: str, selector: Mapping[str, str]) -> tuple[Any, ...]:
    source = figures.FIGURES[q.figure].source
    return (source, q.window_seconds, group_by, tuple(sorted(selector.items())))


def sample_all(queries: Sequence[RuleQuery], now: datetime, fleet: Fleet | None = None) -> dict[int, list[Sample]]:
    """Every rule's samples at ``now``, reading each distinct data set once.
    A rule whose query fails gets the exception instead of samples."""
    fleet = fleet or Fleet(now)
    out: dict[int, Any] = {}

    # First, plan the reads: each metric query key and the figures it needs.
    plans: dict[tuple[Any, ...], set[str]] = defaultdict(set)
    needs: dict[int, tuple[Any, ...]] = {}
    for q in queries:
        if q.figure in FLEET_FIGURES:
            continue
        if q.compare_to:
            # Every pool's value, then each selected pool over its peer.
            key = _key(q, "pool", {})
        else:
            key = _key(q, q.group_by, q.selector)
        plans[key].add(q.figure)
        if q.min_requests_per_second is not None and not q.compare_to:
            plans[key].add(LOAD_FIGURE)  # read with the figure, from the same data
        needs[q.rule_id] = key

    # Then read, each stored window once (see reader).
    peak_windows = {
        key[1]
        for key, names in plans.items()
        if key[0] == "scrape" and any(figures.FIGURES[n].needs_peak_memory for n in names)
    }
    request_windows = [key[1] for key in plans if key[0] == "requests"]
    data = reader.Reader(now, peak_windows=peak_windows, request_window=max(request_windows, default=0.0))
    results: dict[tuple[Any, ...], Any] = {}
    for key, names in plans.items():
        _, window, group_by, selector = key
        try:
            results[key] = data.read(sorted(names), window, group_by, dict(selector))
        except Exception as exc:  # noqa: BLE001 - a bad query fails its rules, not the cycle
            results[key] = exc

    # Last, shape each rule's samples.
    worker_labels = fleet.worker_labels() if any(q.worker_labels for q in queries) else {}
    for q in queries:
        if q.figure in FLEET_FIGURES:
            out[q.rule_id] = _fleet_samples(q, fleet)
            continue
        result = results[needs[q.rule_id]]
        if isinstance(result, Exception):
            out[q.rule_id] = result
            continue
        values: dict[str, float | None] = result.get(q.figure, {})
        if q.compare_to:
            out[q.rule_id] = _ratio_samples(q, values, fleet)
            continue
        load: dict[str, float | None] = result.get(LOAD_FIGURE, {})
        samples = []
        for group, value in values.items():
            if q.worker_labels and not matches_all(
                [Matcher(k, "=", v) for k, v in q.worker_labels.items()], worker_labels.get(group, {})
            ):
                continue
            samples.append(_judged(q, _group_labels(q.group_by, group), value, load.get(group)))
        if not samples and q.group_by == "fleet":
            samples = [Sample({}, None)]
        out[q.rule_id] = samples
    return out


def load_source() -> str:
    """Where the load figure comes from: a rule's figure must come from there too."""
    return figures.FIGURES[LOAD_FIGURE].source


def _judged(q: RuleQuery, labels: dict[str, str], value: float | None, load: float | None) -> Sample:
    """The group's sample, marked idle when the rule needs more load than it
    had. No value at all stays no data (scrapes stopped), whatever the load."""
    least = q.min_requests_per_second
    if least is None or value is None or (load or 0.0) >= least:
        return Sample(labels, value)
    return Sample(labels, value, detail=f"idle: {load or 0.0:.3g} requests/s, below {least:g}", idle=True)


def _ratio_samples(q: RuleQuery, per_pool: Mapping[str, float | None], fleet: Fleet) -> list[Sample]:
    samples = []
    pools = {pool for pool in fleet.routes} | set(per_pool)
    for pool in sorted(pools):
        role = fleet.role_of(pool)
        if q.selector.get("pool") and q.selector["pool"] != pool:
            continue
        if q.selector.get("cohort") and q.selector["cohort"] != role:
            continue
        if not role:
            continue
        peer = fleet.peer(pool, q.compare_to)
        mine = per_pool.get(pool)
        theirs = per_pool.get(peer) if peer else None
        if mine is None or theirs is None or theirs <= 0:
            value = None
        else:
            value = mine / theirs
        detail = f"{pool} {_fmt(mine)} vs {peer or 'no ' + q.compare_to} {_fmt(theirs)}"
        samples.append(Sample({"pool": pool, "cohort": role}, value, raw=mine, detail=detail))
    return samples


def _fmt(value: float | None) -> str:
    return "no data" if value is None else f"{value:.4g}"


def describe_samples(samples: Iterable[Sample]) -> list[dict[str, Any]]:
    return [{"labels": s.labels, "value": s.value, "raw": s.raw, "detail": s.detail} for s in samples]
