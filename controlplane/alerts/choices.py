"""The values an alert rule's fields take, and the labels an acting alert
carries: the model's field choices and the rule checks (``validation.py``)
read them here, so neither imports the other."""

from __future__ import annotations

from controlplane.alerts import lifecycle
from controlplane.alerts.lifecycle import AlertState, NoData

STATE_CHOICES = [(s.value, s.label) for s in AlertState]
SEVERITIES = ("info", "warning", "critical")
SEVERITY_CHOICES = [(s, s) for s in SEVERITIES]
COMPARATOR_CHOICES = [(c, c) for c in lifecycle.COMPARATORS]
NO_DATA_CHOICES = [
    (NoData.NODATA.value, "no data: a state of its own"),
    (NoData.ALERTING.value, "alerting: the condition holds"),
    (NoData.OK.value, "ok: the condition does not hold"),
]
GROUP_BY_CHOICES = [(g, g) for g in ("fleet", "worker", "pool", "cohort")]
ACTION_NOTIFY = "notify"
ACTION_ABORT = "abort_rollout"
ACTION_CHOICES = [(ACTION_NOTIFY, "notify"), (ACTION_ABORT, "abort the rollout that owns the canary")]
COMPARE_CHOICES = [
    ("", "the figure itself"),
    ("baseline", "ratio to the baseline pool of the same routing table (its stable pool if it has none)"),
    ("stable", "ratio to the stable pool of the same routing table"),
]
# The label a firing alert carries to ask an inbound receiver to abort a rollout.
ACTION_LABEL = "chunkpilot_action"
ROLLOUT_LABEL = "rollout"
