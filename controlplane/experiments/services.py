"""One workflow across workloads and experiments, for callers above this
app (the advisor, issue 16): capture a pool's recent traffic and start a
sweep on it in one call."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane import audit
from controlplane.experiments.models import DEFAULT_CHUNK_SIZES, Experiment, Workload
from controlplane.experiments.recommend import DEFAULT_REPEATS
from controlplane.fleet.models import Pool, Worker


def create_experiment(
    *,
    name: str,
    workers: list[Worker],
    pool: Pool | None = None,
    model: str = "",
    window_minutes: float = 15.0,
    workload: Workload | None = None,
    arms: list[dict[str, Any]] | None = None,
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
    duration_seconds: float = 60.0,
    warmup_seconds: float = 10.0,
    repeats: int = DEFAULT_REPEATS,
    objectives: dict[str, float] | None = None,
    actor: audit.Actor = None,
) -> Experiment:
    """Start an experiment on ``workers``: on ``workload``, or on a capture
    of the last ``window_minutes`` of ``pool``'s (and ``model``'s) traffic;
    on ``arms``, or the workers' current profile as the baseline and one
    chunked arm per chunk size that keeps its other knobs. All or nothing:
    a refused experiment keeps no capture. Raises
    Django's ValidationError naming the field (``window`` with the request
    count of an empty window, ``arms[i].<knob>`` for an arm an engine
    refuses, ``workers``)."""
    with transaction.atomic():
        if workload is None:
            end = timezone.now()
            workload = Workload.capture(
                name=f"{pool.name if pool else 'fleet'}-capture",
                pool=pool,
                model=model,
                start=end - timedelta(minutes=window_minutes),
                end=end,
                actor=actor,
            )
        return Experiment.create(
            name=name,
            workload=workload,
            workers=workers,
            arms=arms,
            chunk_sizes=chunk_sizes,
            duration_seconds=duration_seconds,
            warmup_seconds=warmup_seconds,
            repeats=repeats,
            objectives=objectives,
            actor=actor,
        )
