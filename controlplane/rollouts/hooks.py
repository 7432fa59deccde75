"""What the rollouts app plugs into the apps below it, when it loads
(``RolloutsConfig.ready``): those apps never import rollouts.

* ``metrics.exposition``: the rollout gauges (``gauges.py``).
* ``alerts.killswitch``: which rollouts an ``abort_rollout`` alert can abort.
"""

from __future__ import annotations

from controlplane.alerts import killswitch
from controlplane.metrics import exposition
from controlplane.rollouts import gauges
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout


def running_rollouts(canary_pool: str | None) -> list[killswitch.Abortable]:
    rollouts = Rollout.objects.filter(phase__lt=Phase.ABORTING, abort_requested=False)
    if canary_pool is not None:
        rollouts = rollouts.filter(canary_pool__name=canary_pool)
    return list(rollouts)


def rollout(rollout_id: int) -> killswitch.Abortable | None:
    return Rollout.objects.filter(pk=rollout_id).first()


def register() -> None:
    exposition.register(gauges.rollout_gauges)
    killswitch.register(killswitch.Target(running=running_rollouts, get=rollout))
