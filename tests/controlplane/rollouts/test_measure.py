"""One analysis measurement's numbers: the canary pool against its
baseline over the window, rates scaled to 100% of traffic."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.gateway.models import RequestLog
from controlplane.rollouts import measure
from controlplane.rollouts.judge import Direction, MetricRule, RunSpec
from controlplane.rollouts.models import DEFAULT_METRICS, Rollout
from tests.controlplane.rollouts.factories import Fleet, make_fleet

pytestmark = pytest.mark.django_db

SPEC = RunSpec(
    metrics=(
        MetricRule("ttft", "client_ttft_p99", min_samples=1),
        MetricRule("throughput", "client_requests_per_second", Direction.HIGHER, max_ratio=2.0, min_samples=1),
    ),
    interval_seconds=60,
    count=1,
    window_seconds=60,
)


def requests(fleet: Fleet, role: str, n: int, *, ttft: float, start: float, every: float) -> None:
    """``n`` logged requests of one pool, ``start`` seconds ago then one each ``every`` seconds."""
    now = timezone.now()
    pool = {"canary": fleet.canary, "stable": fleet.stable}[role]
    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=f"{role}-{start}-{i}",
                created_at=now - timedelta(seconds=start - i * every),
                model=fleet.table.model,
                cohort=role,
                pool=pool,
                worker=fleet.workers[role][0],
                status=200,
                ttft_seconds=ttft,
                max_gap_seconds=ttft,
                tpot_seconds=0.01,
                e2e_seconds=ttft + 0.1,
                prompt_tokens=100,
                output_tokens=8,
            )
            for i in range(n)
        ]
    )


def rollout(fleet: Fleet, **fields: Any) -> Rollout:
    r = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 1000}],
        actor="tester",
        gate={"enabled": False},
    )
    for name, value in fields.items():
        setattr(r, name, value)
    return r


def test_rates_are_scaled_to_a_full_share_of_traffic_and_latencies_are_not() -> None:
    fleet = make_fleet(num_stable=1)
    # A 10% canary finishing 6 requests a minute keeps pace with a 90% pool finishing 54
    # (both spread over the whole window: rates are over the time with traffic).
    requests(fleet, "canary", 6, ttft=0.3, start=55, every=10)
    requests(fleet, "stable", 54, ttft=0.2, start=60 - 5 / 9, every=10 / 9)
    samples = measure.collect(rollout(fleet), SPEC, {"canary": 1000, "stable": 9000}, timezone.now())
    throughput = samples["throughput"]
    assert throughput.canary == pytest.approx(6 / 60 * 10)
    assert throughput.baseline == pytest.approx(54 / 60 * 10 / 9)
    assert throughput.canary == pytest.approx(throughput.baseline)
    assert (throughput.canary_samples, throughput.baseline_samples) == (6, 54)
    ttft = samples["ttft"]
    assert ttft.canary == pytest.approx(0.3) and ttft.baseline == pytest.approx(0.2)  # not scaled


def test_a_sparse_canary_is_rated_over_the_streams_time_with_traffic_not_its_own() -> None:
    """Issue 26: a 10% canary of a 0.5 req/s stream read 0.83 req/s per share
    against the stable's 0.31. Its three requests a minute, 6 s apart by
    chance, spanned a fraction of the window that the stream had traffic in."""
    fleet = make_fleet(num_stable=1)
    requests(fleet, "canary", 3, ttft=0.3, start=40, every=6)
    requests(fleet, "stable", 27, ttft=0.2, start=59, every=59 / 26)  # 0.45/s through the window
    samples = measure.collect(rollout(fleet), SPEC, {"canary": 1000, "stable": 9000}, timezone.now())
    throughput = samples["throughput"]
    assert throughput.baseline == pytest.approx(27 / 60 / 0.9, rel=0.05)
    assert throughput.canary == pytest.approx(3 / 60 / 0.1, rel=0.05)  # 0.5 per share, as the stable


def test_a_pool_without_weight_has_no_throughput_rather_than_a_division_by_zero() -> None:
    fleet = make_fleet(num_stable=1)
    requests(fleet, "stable", 10, ttft=0.2, start=57, every=6)
    samples = measure.collect(rollout(fleet), SPEC, {"canary": 0, "stable": 10000}, timezone.now())
    assert samples["throughput"].canary is None
    assert samples["throughput"].baseline == pytest.approx(10 / 60)


def test_rates_are_read_only_since_the_step_started_when_the_weights_changed_within_the_window() -> None:
    fleet = make_fleet(num_stable=1)
    # Until 30 s ago the canary had 10% (3 requests); since then 50% (15 in 30 s), the stable the rest.
    requests(fleet, "canary", 3, ttft=0.3, start=59, every=10)
    requests(fleet, "stable", 27, ttft=0.2, start=59.5, every=1)
    requests(fleet, "canary", 15, ttft=0.3, start=29, every=2)
    requests(fleet, "stable", 15, ttft=0.2, start=29.5, every=2)
    now = timezone.now()
    r = rollout(fleet, step_started_at=now - timedelta(seconds=30))
    samples = measure.collect(r, SPEC, {"canary": 5000, "stable": 5000}, now)
    assert samples["throughput"].canary == pytest.approx(15 / 30 * 2)
    assert samples["throughput"].baseline == pytest.approx(15 / 30 * 2)
    # the latencies and the sample counts still cover the whole window
    assert (samples["ttft"].canary_samples, samples["ttft"].baseline_samples) == (18, 42)


def test_the_default_analysis_judges_throughput_per_share_higher_is_better() -> None:
    (rule,) = [m for m in DEFAULT_METRICS if m.name == "throughput"]
    assert rule.figure == "client_requests_per_second" and rule.direction is Direction.HIGHER
