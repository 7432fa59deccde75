"""Rollout gauges on the control plane's own ``/metrics`` (the metrics app's
provider registry, where ``hooks.register`` puts them): one or two queries per scrape."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric

from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout


def rollout_gauges() -> Iterator[Metric]:
    by_phase = GaugeMetricFamily("chunkpilot_rollouts", "Rollouts by phase.", labels=["phase"])
    counts = dict(Rollout.objects.values_list("phase").annotate(n=Count("id")).values_list("phase", "n"))
    for each in Phase:
        by_phase.add_metric([each.label], counts.get(each.value, 0))
    yield by_phase
    labels = ["rollout", "pool", "canary_pool", "phase"]
    step = GaugeMetricFamily("chunkpilot_rollout_step", "Current step index of each unfinished rollout.", labels=labels)
    weight = GaugeMetricFamily(
        "chunkpilot_rollout_canary_weight_bp", "Canary weight (basis points) of each unfinished rollout.", labels=labels
    )
    paused = GaugeMetricFamily("chunkpilot_rollout_paused", "1 while a rollout waits for a person.", labels=labels)
    for rollout_id, pool, canary, phase_value, step_index, weights in Rollout.objects.active().values_list(
        "id", "stable_pool__name", "canary_pool__name", "phase", "step_index", "weights"
    ):
        values = [str(rollout_id), pool, canary, Phase(phase_value).label]
        step.add_metric(values, step_index)
        weight.add_metric(values, (weights or {}).get("canary", 0))
        paused.add_metric(values, 1 if phase_value == Phase.PAUSED else 0)
    yield step
    yield weight
    yield paused
