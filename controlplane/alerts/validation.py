"""Why a rule, a route, a receiver or a silence is wrong, by field.

Each function returns ``{"field": ["reason", ...]}``, empty when all is well;
models raise it as Django's ValidationError (the API answers 400 with it),
forms show it beside the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from controlplane.alerts import lifecycle, sources
from controlplane.alerts.choices import ACTION_ABORT, ACTION_CHOICES, SEVERITIES
from controlplane.alerts.labels import ALERT_NAME, MatcherError, coerce_matcher, label_errors
from controlplane.fleet.pools import ROLES

MAX_WINDOW_SECONDS = 14 * 86400.0  # the metrics' rollup retention
MIN_WINDOW_SECONDS = 10.0
MAX_HOLD_SECONDS = 7 * 86400.0
RESERVED_LABELS = ("alertname", "severity")
ANNOTATION_KEYS = ("summary", "description", "runbook_url", "dashboard_url")

Errors = dict[str, list[str]]


def _add(errors: Errors, field: str, message: str) -> None:
    errors.setdefault(field, []).append(message)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rule_errors(rule: Any) -> Errors:
    errors: Errors = {}
    if not isinstance(rule.name, str) or not ALERT_NAME.match(rule.name or ""):
        _add(
            errors,
            "name",
            "a name is letters, digits and underscores, not starting with a digit "
            "(it becomes the alertname label), e.g. CanaryTTFTRegression.",
        )

    # The figure, and how it may be grouped.
    info = sources.figure_info(rule.figure or "")
    if info is None:
        _add(errors, "figure", f"`{rule.figure}` is not a figure; one of {', '.join(sources.figure_names())}.")
    elif rule.group_by not in sources.group_by_choices(rule.figure):
        _add(errors, "group_by", f"{rule.figure} groups by {', '.join(sources.group_by_choices(rule.figure))}.")

    # The selector.
    selector = rule.selector
    cohort = ""
    if not isinstance(selector, Mapping):
        _add(errors, "selector", 'an object such as {"pool": "gpu-a", "cohort": "canary"}.')
    else:
        for key, value in selector.items():
            if key not in sources.SELECTOR_KEYS:
                _add(errors, "selector", f"unknown key `{key}`; keys are {', '.join(sources.SELECTOR_KEYS)}.")
            elif key == "labels":
                for problem in label_errors(value, "worker label"):
                    _add(errors, "selector", f"labels: {problem}")
            elif not isinstance(value, str) or not value:
                _add(errors, "selector", f"`{key}` is a non-empty string.")
        cohort = selector.get("cohort", "") if isinstance(selector.get("cohort"), str) else ""
        if cohort and cohort not in _roles():
            _add(errors, "selector", f"cohort `{cohort}` is not a role; roles are {', '.join(_roles())}.")
        if selector.get("labels") and info is not None and info.get("source") != "fleet" and rule.group_by != "worker":
            _add(errors, "selector", "worker labels select workers: group this figure by worker to use them.")

    # The window, the comparison and the timings.
    if not _finite(rule.window_seconds) or not (MIN_WINDOW_SECONDS <= rule.window_seconds <= MAX_WINDOW_SECONDS):
        _add(errors, "window_seconds", f"between {MIN_WINDOW_SECONDS:g} s and 14 days.")
    if rule.comparator not in lifecycle.COMPARATORS:
        _add(errors, "comparator", f"one of {' '.join(lifecycle.COMPARATORS)}.")
    if not _finite(rule.threshold):
        _add(errors, "threshold", "a finite number.")
    elif info is not None:
        if rule.compare_to and rule.threshold <= 0:
            _add(errors, "threshold", "a ratio to a peer is above 0 (e.g. 1.2 for 20% worse).")
        elif rule.threshold < 0:
            # Every figure is a duration, a rate, a count or a ratio of them.
            _add(errors, "threshold", f"{rule.figure} is never negative; a threshold below 0 means nothing.")
    for field in ("for_seconds", "keep_firing_for_seconds"):
        value = getattr(rule, field)
        if not _finite(value) or not (0 <= value <= MAX_HOLD_SECONDS):
            _add(errors, field, "between 0 and 7 days.")
    if rule.no_data_state not in {n.value for n in lifecycle.NoData}:
        _add(errors, "no_data_state", f"one of {', '.join(n.value for n in lifecycle.NoData)}.")
    if rule.severity not in SEVERITIES:
        _add(errors, "severity", f"one of {', '.join(SEVERITIES)}.")

    # Comparing with a peer pool.
    if rule.compare_to:
        if rule.compare_to not in ("baseline", "stable"):
            _add(errors, "compare_to", "baseline or stable.")
        elif rule.group_by != "pool":
            _add(errors, "compare_to", "a ratio to a peer pool is per pool: group by pool.")
        if info is not None and info.get("source") == "fleet":
            _add(errors, "compare_to", f"{rule.figure} is not compared between pools.")
        if cohort == rule.compare_to:
            _add(errors, "compare_to", f"the {cohort} cohort compared with itself is always 1.")
    if rule.min_requests_per_second is not None:
        if not _finite(rule.min_requests_per_second) or rule.min_requests_per_second < 0:
            _add(errors, "min_requests_per_second", "a number of requests/s, 0 or more.")
        elif rule.compare_to or (info is not None and info.get("source") != sources.load_source()):
            _add(
                errors,
                "min_requests_per_second",
                f"applies to a figure scraped with {sources.LOAD_FIGURE}, not to a ratio to a peer or fleet state.",
            )
    if rule.floor is not None:
        if not rule.compare_to:
            _add(errors, "floor", "a floor applies to ratio rules (compare_to); set the threshold instead.")
        elif not _finite(rule.floor):
            _add(errors, "floor", "a finite number.")

    # Labels and annotations.
    labels = rule.labels
    for problem in label_errors(labels):
        _add(errors, "labels", problem)
    if isinstance(labels, Mapping):
        for name in RESERVED_LABELS:
            if name in labels:
                _add(errors, "labels", f"`{name}` is set from the rule's {'name' if name == 'alertname' else name}.")

    # The action.
    if rule.action not in {a for a, _ in ACTION_CHOICES}:
        _add(errors, "action", "notify or abort_rollout.")
    elif rule.action == ACTION_ABORT:
        if cohort != "canary":
            _add(errors, "action", 'abort_rollout applies only to canary cohorts: select {"cohort": "canary"}.')
        if info is not None and info.get("source") == "fleet" and rule.figure == sources.PROFILE_DRIFT:
            _add(errors, "action", "drift is what every rollout goes through; it cannot abort one.")
    return errors


def _roles() -> tuple[str, ...]:
    return ROLES


def matcher_errors(matchers: Any, field: str = "matchers", *, required: bool = False) -> Errors:
    errors: Errors = {}
    if not isinstance(matchers, list):
        return {field: ["a list of matchers."]}
    if required and not matchers:
        _add(errors, field, "at least one matcher.")
    for item in matchers:
        try:
            coerce_matcher(item)
        except MatcherError as exc:
            _add(errors, field, str(exc))
    return errors


def silence_errors(
    matchers: Any, starts_at: datetime | None, ends_at: datetime | None, comment: str, now: datetime, *, creating: bool
) -> Errors:
    errors = matcher_errors(matchers, required=True)
    if isinstance(matchers, list) and matchers and "matchers" not in errors:
        parsed = [coerce_matcher(m) for m in matchers]
        # Alertmanager refuses a silence that would match every alert.
        if all(m.matches({}) for m in parsed):
            _add(
                errors,
                "matchers",
                "these matchers match every alert (each matches an empty label); name at least one label value.",
            )
    if starts_at is None:
        _add(errors, "starts_at", "required.")
    if ends_at is None:
        _add(errors, "ends_at", "required.")
    elif starts_at is not None and ends_at <= starts_at:
        _add(errors, "ends_at", "must be after starts_at.")
    elif creating and ends_at <= now:
        _add(errors, "ends_at", "must be in the future.")
    if not (comment or "").strip():
        _add(errors, "comment", "say why: a silence without a reason is a mystery at 3 a.m.")
    return errors


def receiver_errors(kind: str, url: str, emails: Any) -> Errors:
    errors: Errors = {}
    if kind in ("webhook", "alertmanager") and not url:
        _add(errors, "url", f"a {kind} receiver needs a URL.")
    if kind == "email":
        if not isinstance(emails, list) or not emails or not all(isinstance(e, str) and "@" in e for e in emails):
            _add(errors, "emails", "a list of at least one email address.")
    return errors


def route_errors(matchers: Any, group_by: Any, timings: Mapping[str, Any]) -> Errors:
    errors = matcher_errors(matchers)
    if not isinstance(group_by, list) or not all(isinstance(n, str) for n in group_by):
        _add(errors, "group_by", 'a list of label names, or ["..."] for every label.')
    else:
        for name in group_by:
            if name != "..." and not ALERT_NAME.match(name):
                _add(errors, "group_by", f"`{name}` is not a label name.")
    for field, value in timings.items():
        if not _finite(value) or value < 0 or (field != "group_wait_seconds" and value <= 0):
            _add(errors, field, "a positive number of seconds.")
    if _finite(timings.get("repeat_interval_seconds")) and _finite(timings.get("group_interval_seconds")):
        if timings["repeat_interval_seconds"] < timings["group_interval_seconds"]:
            _add(
                errors,
                "repeat_interval_seconds",
                "at least the group interval (notifications are sent at group intervals).",
            )
    return errors
