"""``python manage.py bench_workload``: what the largest workload the API
allows costs the web process that draws it.

``POST /api/v1/workloads/`` with ``source: loadgen`` draws the scenario's
requests inside the request (``Workload.from_scenario``), so its size is
bounded (``MAX_LOADGEN_REQUESTS``: rate × duration). This draws the largest
allowed workload of each scenario, and one a tenth of its size in the same
run for the ratio, and reports wall time and the Python heap's peak
(tracemalloc) of each; each draw is rolled back, nothing is kept.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction

from controlplane.experiments.api import MAX_LOADGEN_REQUESTS
from controlplane.experiments.models import Workload
from workers import loadgen


class RolledBack(Exception):
    pass


def draw(scenario: str, num_requests: int, *, trace: bool) -> tuple[float, int, int]:
    """Seconds, peak heap bytes (with ``trace``; tracemalloc slows the draw
    several times, so time is taken on a draw without it) and requests of one
    draw of ``num_requests``."""
    rate = 10.0
    if trace:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        with transaction.atomic():
            workload = Workload.from_scenario(
                name="bench-workload", scenario=scenario, rate=rate, duration_seconds=num_requests / rate
            )
            drawn = workload.num_requests
            raise RolledBack
    except RolledBack:
        pass
    seconds = time.perf_counter() - started
    peak = 0
    if trace:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return seconds, peak, drawn


class Command(BaseCommand):
    help = "Time and memory of drawing the largest loadgen workload the API allows, per scenario"

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--scenarios", default=",".join(loadgen.SCENARIOS))

    def handle(self, *args: Any, **options: Any) -> None:
        largest = MAX_LOADGEN_REQUESTS
        self.stdout.write(f"largest allowed: {largest} requests (rate x duration)")
        self.stdout.write(f"{'scenario':<12} {'requests':>9} {'seconds':>8} {'peak MB':>8}   ratio to a tenth")
        for scenario in options["scenarios"].split(","):
            runs = []
            for size in (largest // 10, largest):
                seconds, _, drawn = draw(scenario, size, trace=False)
                _, peak, _ = draw(scenario, size, trace=True)
                runs.append((seconds, peak, drawn))
            small, big = runs
            for (seconds, peak, drawn), ratio in ((small, ""), (big, f"{big[0] / small[0]:.1f}x time")):
                self.stdout.write(f"{scenario:<12} {drawn:>9} {seconds:>8.2f} {peak / 1e6:>8.1f}   {ratio}")
