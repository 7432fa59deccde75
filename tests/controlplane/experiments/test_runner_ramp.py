"""The capacity ramp, run by the runner (driven in this process step by
step) against a real reference worker on the tiny model; a thread plays the
worker's agent (it follows its desired revision). Each ramp point is stored
as it is taken, the ramp stops at the first rate that misses, the arm's
capacity is the one its points show, and the recommendation is judged on
it; a resumed runner measures no point twice."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from controlplane.experiments import runner
from controlplane.experiments.capacity import RampPoint, serving_capacity
from controlplane.experiments.models import Arm, ArmStatus, Experiment, Phase, Workload
from controlplane.fleet.models import Worker
from dashboards.experiments.pages import detail_context
from tests.controlplane.factories import enroll_worker, make_pool, make_profile
from tests.controlplane.rollouts.factories import follow
from tests.support import PYTHON, child_env, free_port, running

pytestmark = pytest.mark.django_db(transaction=True)
MAX_MODEL_LEN = 512
ARMS = [
    {
        "name": "chunk-64",
        "fields": {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 128,
            "long_prefill_token_threshold": 64,
            "max_num_seqs": 16,
        },
    }
]
RAMP = [0.5, 1.0, 2.0]


@pytest.fixture(autouse=True)
def fast(settings: Any) -> None:
    settings.GATEWAY_POLL_SECONDS = 0.1
    settings.EXPERIMENT_DRAIN_TIMEOUT_SECONDS = 1.0
    settings.EXPERIMENT_APPLY_TIMEOUT_SECONDS = 10.0


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reference worker's OpenAI server on the tiny model (no agent)."""
    port = free_port()
    log = tmp_path_factory.mktemp("ramp") / "worker.log"
    argv = [
        PYTHON,
        "-m",
        "workers",
        "serve",
        "--model",
        str(tiny_model),
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    with running(argv, env=child_env(), log_path=log) as proc:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=240)  # 200 once the engine is ready
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def worker(served: str) -> Iterator[Worker]:
    pool = make_pool(revision=make_profile())
    w, _ = enroll_worker("lab", pool=pool, url=served, max_model_len=MAX_MODEL_LEN)
    stop = threading.Event()

    def agent() -> None:
        try:
            while not stop.wait(0.1):
                follow(only=[w], beat_all=True)
        finally:
            connection.close()

    follow(only=[w])
    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    yield Worker.objects.get(pk=w.pk)
    stop.set()
    thread.join(10)


def experiment(worker: Worker, objectives: dict[str, float] | None = None, **options: Any) -> Experiment:
    """A capacity ramp over ``RAMP`` unless ``options`` say otherwise."""
    workload = Workload.from_scenario(name="ramp", scenario="long-tail", rate=4.0, duration_seconds=30)
    defaults = {"duration_seconds": 2, "warmup_seconds": 0, "capacity_rate_scales": RAMP, "capacity_seconds": 2}
    return Experiment.create(
        name="ramp", workload=workload, workers=[worker], arms=ARMS, objectives=objectives, **{**defaults, **options}
    )


def run_to_the_end(exp: Experiment, max_steps: int = 20) -> Experiment:
    for _ in range(max_steps):
        if not runner.drive(exp.pk):
            break
    return Experiment.objects.get(pk=exp.pk)


def test_every_rate_that_holds_is_measured_and_the_capacity_is_what_the_points_show(worker: Worker) -> None:
    exp = run_to_the_end(experiment(worker, {"ttft_ms": 600000, "tpot_ms": 600000}))
    assert exp.phase == Phase.SUCCEEDED, exp.message
    arm = exp.arms.get()
    assert arm.status == ArmStatus.SUCCEEDED, arm.error
    base = exp.workload.workload_spec().rate_per_second
    assert [p["index"] for p in arm.ramp] == [0, 1, 2]  # each rate once, in order
    assert [p["rate"] for p in arm.ramp] == pytest.approx([base * r for r in RAMP])
    assert all(p["num_requests"] >= runner.RAMP_MIN_REQUESTS for p in arm.ramp), arm.ramp
    assert [(p["failed_requests"], p["failure_reasons"]) for p in arm.ramp] == [(0, [])] * len(RAMP)
    assert all(p["attainment"] == 1.0 for p in arm.ramp), arm.ramp  # objectives nothing can miss
    assert arm.capacity == pytest.approx(base * RAMP[-1])
    assert arm.summary["capacity"]["mean"] == arm.capacity
    # One ramp per arm has no interval: capacity is shown, goodput over the paired repeats decides.
    assert exp.recommendation["winner"] == "chunk-64" and exp.recommendation["basis"] == "goodput"
    table = detail_context(exp)
    assert "capacity" in [c["key"] for c in table["columns"]]
    assert [c["mean"] for c in table["rows"][0]["cells"] if c["key"] == "capacity"] == [arm.capacity]

    # A runner lost after the first point: its successor takes the rest, and
    # only the rest.
    first = arm.ramp[0]
    Arm.objects.filter(pk=arm.pk).update(ramp=[first], capacity=None)
    Experiment.objects.filter(pk=exp.pk).update(lease_token="resumed")
    arm.refresh_from_db()
    runner.run_ramp(exp, arm, [worker], runner.Lease(exp.pk, "resumed"), 1)
    arm.refresh_from_db()
    assert arm.ramp[0] == first and [p["index"] for p in arm.ramp] == [0, 1, 2]
    assert arm.capacity == serving_capacity([RampPoint.from_json(p) for p in arm.ramp])


def test_the_ramp_stops_at_the_first_rate_that_misses(worker: Worker) -> None:
    exp = run_to_the_end(experiment(worker, {"ttft_ms": 0.001, "tpot_ms": 600000}))  # no TTFT is that short
    arm = exp.arms.get()
    assert arm.status == ArmStatus.SUCCEEDED, arm.error
    assert len(arm.ramp) == 1 and arm.ramp[0]["attainment"] == 0.0, arm.ramp
    assert arm.capacity == 0.0 == serving_capacity([RampPoint.from_json(p) for p in arm.ramp])
    assert exp.recommendation["winner"] is None  # it broke the TTFT objective too


def test_each_repeat_of_an_arm_is_drawn_afresh_and_measured_once(worker: Worker) -> None:
    # Every repeat after the first plans its own requests from the workload,
    # with its own seed; a plan left over from the one before must not stand
    # in for it.
    exp = run_to_the_end(experiment(worker, capacity_rate_scales=[], warmup_seconds=1, repeats=2))
    assert exp.phase == Phase.SUCCEEDED, exp.message
    arm = exp.arms.get()
    assert arm.status == ArmStatus.SUCCEEDED, arm.error
    assert [r["repeat"] for r in arm.results] == [0, 1]
    assert all(r["figures"]["num_requests"] > 0 and r["figures"]["failed_requests"] == 0 for r in arm.results)
