"""bench_workload draws a workload the way the API does and keeps nothing."""

from __future__ import annotations

import pytest

from controlplane.bench.management.commands.bench_workload import draw
from controlplane.experiments.models import Workload

pytestmark = pytest.mark.django_db


def test_a_draw_counts_its_requests_and_heap_and_is_rolled_back() -> None:
    seconds, peak, drawn = draw("burst", 200, trace=True)
    assert drawn == 200 and seconds > 0 and peak > 0
    assert not Workload.objects.exists()
