"""The rollouts app's gauges (``controlplane.rollouts.gauges``) on the
control plane's own ``/metrics``, as Prometheus reads them."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.accounts.roles import Role
from controlplane.rollouts.models import Rollout
from tests.controlplane.factories import api_client, make_user
from tests.controlplane.rollouts.factories import make_fleet

pytestmark = pytest.mark.django_db


def started(model: str, *, phase: Rollout.Phase, step_index: int, canary_bp: int) -> Rollout:
    """A rollout made through the product, then where the reconciler left it."""
    fleet = make_fleet(model)
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor=None,
    )
    Rollout.objects.filter(pk=rollout.pk).update(
        phase=phase, step_index=step_index, weights={"canary": canary_bp, "stable": 10000 - canary_bp}
    )
    return rollout


def scrape() -> dict[str, Any]:
    reply = api_client(make_user(Role.VIEWER)).get("/metrics")
    assert reply.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(reply.content.decode())}


def by_rollout(family: Any) -> dict[tuple[str, str, str, str], float]:
    return {
        (s.labels["rollout"], s.labels["pool"], s.labels["canary_pool"], s.labels["phase"]): s.value
        for s in family.samples
    }


def test_rollout_gauges_report_each_unfinished_rollouts_step_weight_and_pause() -> None:
    paused = started("a", phase=Rollout.Phase.PAUSED, step_index=2, canary_bp=2500)
    moving = started("b", phase=Rollout.Phase.PROGRESSING, step_index=1, canary_bp=1000)
    started("c", phase=Rollout.Phase.SUCCEEDED, step_index=5, canary_bp=0)
    families = scrape()

    phases = {s.labels["phase"]: s.value for s in families["chunkpilot_rollouts"].samples}
    assert phases == {
        "pending": 0,
        "progressing": 1,
        "paused": 1,
        "promoting": 0,
        "aborting": 0,
        "aborted": 0,
        "succeeded": 1,
    }
    p = (str(paused.pk), paused.stable_pool.name, paused.canary_pool.name, "paused")
    m = (str(moving.pk), moving.stable_pool.name, moving.canary_pool.name, "progressing")
    # The finished rollout has no series of its own.
    assert by_rollout(families["chunkpilot_rollout_step"]) == {p: 2, m: 1}
    assert by_rollout(families["chunkpilot_rollout_canary_weight_bp"]) == {p: 2500, m: 1000}
    assert by_rollout(families["chunkpilot_rollout_paused"]) == {p: 1, m: 0}


def test_with_no_rollout_every_phase_reads_zero_and_no_rollout_has_a_series() -> None:
    families = scrape()
    assert {s.labels["phase"]: s.value for s in families["chunkpilot_rollouts"].samples} == {
        phase.label: 0 for phase in Rollout.Phase
    }
    for name in ("chunkpilot_rollout_step", "chunkpilot_rollout_canary_weight_bp", "chunkpilot_rollout_paused"):
        assert families[name].samples == []
