"""Pure pieces of equal conditions: the interleaved schedule, an arm's
conditions beside the workload's (flagged past 10%), the registry's figure
names, and the migration that renamed stored results (and its read-compat)."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
from django.apps import apps

from controlplane.experiments import measure
from controlplane.experiments.models import Arm, Experiment, Workload
from controlplane.experiments.runner import schedule
from controlplane.metrics.figures import FIGURES as REGISTRY
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

migration = importlib.import_module("controlplane.experiments.migrations.0003_paired_repeats_registry_names")


def test_arms_interleave_and_each_takes_every_position_once() -> None:
    order = schedule(3, 3)
    assert order == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]
    positions = {arm: [k % 3 for k, (_, a) in enumerate(order) if a == arm] for arm in range(3)}
    assert all(sorted(p) == [0, 1, 2] for p in positions.values())  # a Latin square: drift falls on all alike
    assert Counter(r for r, _ in order) == {0: 3, 1: 3, 2: 3}  # repeat by repeat


def result(repeat: int, sent: int, ok: int, share: float | None, queries: float = 1000.0) -> dict:
    return {
        "repeat": repeat,
        "client": {"num_requests": sent, "successful_requests": ok},
        "figures": {"prefix_hit_share": share, "prefix_cache_queries": queries},
    }


@pytest.mark.parametrize(
    ("results", "flags"),
    [
        ([result(0, 32, 32, 0.40), result(1, 32, 32, 0.42)], []),
        ([result(0, 32, 32, 0.99), result(1, 32, 32, 0.98)], ["prefix-hit share 98% against the workload's 40%"]),
        ([result(0, 32, 20, 0.40), result(1, 32, 22, 0.40)], ["achieved 1.05 requests/s against the workload's 1.6"]),
        ([result(0, 32, 30, 0.37)], []),  # 6% and 7.5% off: inside 10%
    ],
)
def test_an_arm_more_than_ten_percent_off_the_workload_is_not_comparable(results: list, flags: list) -> None:
    c = measure.arm_conditions(results, arrival_seconds=20.0, workload_rate=1.6, workload_prefix_share=0.40)
    assert list(c.not_comparable) == flags
    assert c.requests_sent == sum(r["client"]["num_requests"] for r in results)
    assert c.requests_completed == sum(r["client"]["successful_requests"] for r in results)


def test_a_workload_without_sharing_is_not_flagged_by_a_stray_hit() -> None:
    c = measure.arm_conditions(
        [result(0, 10, 10, 0.004)], arrival_seconds=10.0, workload_rate=1.0, workload_prefix_share=0.0
    )
    assert c.not_comparable == ()
    warm = measure.arm_conditions(
        [result(0, 10, 10, 0.9)], arrival_seconds=10.0, workload_rate=1.0, workload_prefix_share=0.0
    )
    assert warm.not_comparable == ("prefix-hit share 90% against the workload's 0%",)


def test_the_client_timings_carry_the_registrys_client_names() -> None:
    registry = set(REGISTRY)
    client = [key for key, *_ in measure.FIGURES if key.startswith("client_")]
    assert set(client) == {"client_ttft_p99", "client_stall_p99", "client_itl_p99", "client_tpot_p99"}
    assert {"client_ttft_p99", "client_stall_p99", "client_tpot_p99"} <= registry
    figures = measure.repeat_figures(
        {
            "output_throughput": 1.0,
            "goodput": 1.0,
            "failed_requests": 0,
            "num_requests": 3,
            **{f"{n}_ms": {"p99": 100.0} for n in ("ttft", "max_gap", "itl", "tpot")},
        },
        {"ttft_p99": 0.2, "itl_p99": 0.01},
    )
    assert figures["client_ttft_p99"] == 0.1 and figures["ttft_p99"] == 0.2 and figures["itl_p99"] == 0.01
    assert {"ttft_p99", "itl_p99"} <= registry  # the workers' figures take the registry's plain names


OLD = {"ttft_p99": 0.5, "stall_p99": 0.3, "tbt_p99": 0.02, "tpot_p99": 0.05, "worker_ttft_p99": 0.4, "goodput": 1.0}
NEW = {
    "client_ttft_p99": 0.5,
    "client_stall_p99": 0.3,
    "client_itl_p99": 0.02,
    "client_tpot_p99": 0.05,
    "ttft_p99": 0.4,
    "goodput": 1.0,
}


def test_results_stored_under_the_old_names_read_under_the_new() -> None:
    assert measure.upgrade_figures(OLD) == NEW
    assert measure.upgrade_figures(NEW) == NEW  # new ones as they are
    summary = measure.summarize([{"figures": OLD}, {"figures": NEW}])
    assert summary["client_stall_p99"]["values"] == [0.3, 0.3] and "stall_p99" not in summary


@pytest.mark.django_db
def test_the_migration_renames_stored_results_and_back() -> None:
    worker, _ = enroll_worker("m", pool=make_pool(revision=make_profile()))
    workload = Workload.from_scenario(name="m", scenario="burst", rate=1.0, duration_seconds=30)
    exp = Experiment.create(
        name="m", workload=workload, workers=[worker], arms=[{"name": "a", "fields": {}}], repeats=1
    )
    arm = exp.arms.get()
    Arm.objects.filter(pk=arm.pk).update(
        results=[{"repeat": 0, "figures": OLD}],
        summary={k: {"mean": v} for k, v in OLD.items()},
        ramp=[{"index": 0, "ttft_p99": 0.1, "tpot_p99": 0.01}],
    )
    migration.forward(apps, None)
    arm.refresh_from_db()
    assert arm.results[0]["figures"] == NEW
    assert set(arm.summary) == set(NEW) and arm.summary["client_itl_p99"] == {"mean": 0.02}
    assert arm.ramp == [{"index": 0, "client_ttft_p99": 0.1, "client_tpot_p99": 0.01}]
    migration.forward(apps, None)  # twice is harmless
    arm.refresh_from_db()
    assert arm.results[0]["figures"] == NEW
    migration.backward(apps, None)
    arm.refresh_from_db()
    assert arm.results[0]["figures"] == OLD and arm.ramp == [{"index": 0, "ttft_p99": 0.1, "tpot_p99": 0.01}]
