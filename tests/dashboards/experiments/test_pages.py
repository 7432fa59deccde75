"""The experiment pages rendered by Django: the list, a workload's
histograms, one experiment with its results (with spread), plot data and
recommendation, the buttons (abort sets a flag; adopt opens "New rollout"
with the revision it made), "New experiment" with working defaults, role
checks, and the consumer pushing progress."""

from __future__ import annotations

import json
import re

import pytest
from channels.db import database_sync_to_async
from django.test import Client

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.experiments.models import ArmStatus, Experiment, Phase, Workload
from controlplane.fleet.models import Worker
from controlplane.metrics.models import ServiceObjectives
from tests.controlplane.factories import enroll_worker, make_pool, make_profile, make_user
from tests.dashboards.support import run, socket

pytestmark = pytest.mark.django_db


def lab_worker(name: str = "lab-1") -> Worker:
    worker, _ = enroll_worker(name, pool=make_pool(revision=make_profile()), labels={"demo_pool": "lab"})
    Worker.objects.filter(pk=worker.pk).update(state=Worker.State.READY)
    return Worker.objects.get(pk=worker.pk)


def finished_experiment() -> Experiment:
    workload = Workload.from_scenario(name="lt", scenario="long-tail", rate=2.0, duration_seconds=60)
    worker = lab_worker()
    exp = Experiment.create(name="sweep", workload=workload, workers=[worker], repeats=2)
    for arm in exp.arms.all():
        base = 10.0 + (arm.chunk_size or 0) / 256
        results = [
            {
                "repeat": r,
                "figures": {
                    "output_throughput": base + r,
                    "goodput": base / 10 + r * 0.01,
                    "ttft_p99": 0.5,
                    "stall_p99": 0.25,
                    "tpot_p99": 0.05,
                },
            }
            for r in range(2)
        ]
        summary = {
            k: {
                "mean": sum(x["figures"][k] for x in results) / 2,
                "half_range": abs(results[1]["figures"][k] - results[0]["figures"][k]) / 2,
            }
            for k in results[0]["figures"]
        }
        arm.results, arm.summary, arm.status = results, summary, ArmStatus.SUCCEEDED
        arm.save()
    from controlplane.experiments.runner import recommendation

    Experiment.objects.filter(pk=exp.pk).update(
        phase=Phase.SUCCEEDED,
        recommendation=recommendation(exp),
        previous={
            str(worker.pk): {
                "desired_revision": None,
                "running_revision": worker.pool.desired_revision_id,
                "cordoned": False,
            }
        },
    )
    return Experiment.objects.get(pk=exp.pk)


def test_the_list_shows_experiments_and_workloads(viewer_client: Client) -> None:
    exp = finished_experiment()
    html = viewer_client.get("/experiments/").content.decode()
    assert f'data-experiment="{exp.pk}"' in html and f'data-workload="{exp.workload_id}"' in html
    assert 'ws-connect="/ws/experiments/"' in html
    assert "New experiment" not in html  # viewers cannot start one


def test_a_workload_page_draws_its_length_histograms(viewer_client: Client) -> None:
    workload = Workload.from_scenario(name="lt", scenario="long-tail", rate=2.0, duration_seconds=120)
    html = viewer_client.get(f"/experiments/workloads/{workload.pk}/").content.decode()
    assert 'id="prompt-histogram"' in html and 'id="output-histogram"' in html
    counts = [int(c) for c in re.findall(r'class="hbar"[^>]*data-count="(\d+)"', html)]
    assert sum(counts) == 2 * workload.num_requests  # every request in both histograms
    assert "workers replay" in html


def test_the_detail_shows_results_with_spread_plot_data_and_recommendation(operator_client: Client) -> None:
    exp = finished_experiment()
    html = operator_client.get(f"/experiments/{exp.pk}/").content.decode()
    assert f'ws-connect="/ws/experiments/{exp.pk}/"' in html
    assert 'data-arm="baseline"' in html and 'data-arm="chunk-2048"' in html
    assert "± 0.50" in html  # throughput's half range over the two repeats
    data = json.loads(re.search(r'id="experiment-plot-data">(.*?)</script>', html, re.S).group(1))
    assert data["x"] == [256, 512, 1024, 2048]
    assert data["baseline"]["output_throughput"] == pytest.approx(10.5)
    # Each value axis from zero over every point and the baseline, so arms 1% apart do not look a cliff apart.
    for scale, names in (("tok", ("output_throughput",)), ("req", ("goodput",)), ("s", ("ttft_p99", "stall_p99"))):
        axis = data["axes"][scale]
        values = [v for n in names for v in (*data[n], data["baseline"][n]) if v is not None]
        assert axis["min"] == 0 and max(values) <= axis["max"], (scale, axis)
        assert len(set(axis["labels"])) == len(axis["ticks"]), axis
    assert data["x_range"] == [256, 2048]
    assert "data-winner>chunk-2048<" in html and "highest goodput" in html
    assert 'data-button="adopt"' in html and 'data-button="abort"' not in html


def test_adopt_makes_a_revision_and_opens_new_rollout_with_it(operator_client: Client) -> None:
    exp = finished_experiment()
    response = operator_client.post(f"/experiments/{exp.pk}/adopt/")
    assert response.status_code == 302
    match = re.fullmatch(r"/rollouts/new/\?revision=(\d+)", response["Location"])
    assert match
    page = operator_client.get(response["Location"]).content.decode()
    assert f'<option value="{match.group(1)}" selected>' in page
    assert AuditEvent.objects.filter(action="experiment.adopt").exists()


def test_abort_sets_the_flag(operator_client: Client) -> None:
    workload = Workload.from_scenario(name="lt", scenario="burst", rate=1.0, duration_seconds=30)
    exp = Experiment.create(name="x", workload=workload, workers=[lab_worker()])
    assert 'data-button="abort"' in operator_client.get(f"/experiments/{exp.pk}/").content.decode()
    operator_client.post(f"/experiments/{exp.pk}/abort/", {"reason": "need it back"})
    exp.refresh_from_db()
    assert exp.abort_requested and exp.abort_reason == "need it back"


def test_viewers_may_not_press_buttons(viewer_client: Client) -> None:
    exp = finished_experiment()
    assert 'data-button="adopt"' not in viewer_client.get(f"/experiments/{exp.pk}/").content.decode()
    assert viewer_client.post(f"/experiments/{exp.pk}/adopt/").status_code == 403
    assert viewer_client.get("/experiments/new/").status_code == 403


def test_new_experiment_defaults_to_the_lab_worker_and_starts_with_them(operator_client: Client) -> None:
    worker = lab_worker("demo-lab")
    html = operator_client.get("/experiments/new/").content.decode()
    assert re.search(r'<option value="demo-lab" selected>', html)
    form = {
        "name": "from the ui",
        "workload": "scenario",
        "scenario": "long-tail",
        "scenario_rate": "1",
        "capture_minutes": "15",
        "workers": [worker.name],
        "chunk_sizes": "256, 512, 1024, 2048",
        "budgets": "",
        "short_prompt_thresholds": "",
        "duration_seconds": "20",
        "warmup_seconds": "5",
        "repeats": "1",
        "rate_scale": "1",
        "ttft_ms": "2000",
        "tpot_ms": "200",
    }
    response = operator_client.post("/experiments/new/", form)
    assert response.status_code == 302, response.content.decode()[-2000:]
    exp = Experiment.objects.get(name="from the ui")
    assert response["Location"] == f"/experiments/{exp.pk}/"
    assert exp.arms.count() == 5 and list(exp.workers.all()) == [worker]


def test_new_experiment_shows_an_arm_the_engine_refuses(operator_client: Client) -> None:
    worker = lab_worker("demo-lab")
    form = {
        "name": "bad",
        "workload": "scenario",
        "scenario": "burst",
        "scenario_rate": "1",
        "workers": [worker.name],
        "chunk_sizes": "256",
        "budgets": "16",
        "duration_seconds": "20",
        "warmup_seconds": "5",
        "repeats": "1",
        "rate_scale": "1",
        "ttft_ms": "2000",
        "tpot_ms": "200",
    }
    html = operator_client.post("/experiments/new/", form).content.decode()
    assert "chunk-256-budget-16" in html and "below max_num_seqs" in html
    assert not Experiment.objects.exists() and not Workload.objects.exists()  # the capture rolled back too


def test_new_experiment_takes_a_capacity_ramp_and_names_a_bad_one(operator_client: Client) -> None:
    worker = lab_worker("demo-lab")
    form = {
        "name": "ramp",
        "workload": "scenario",
        "scenario": "burst",
        "scenario_rate": "1",
        "workers": [worker.name],
        "chunk_sizes": "256",
        "duration_seconds": "20",
        "warmup_seconds": "5",
        "repeats": "1",
        "rate_scale": "1",
        "ttft_ms": "2000",
        "tpot_ms": "200",
        "capacity_rate_scales": "4, 2",
        "capacity_seconds": "10",
    }
    html = operator_client.post("/experiments/new/", form).content.decode()
    assert "must rise strictly" in html and not Experiment.objects.exists()
    response = operator_client.post("/experiments/new/", {**form, "capacity_rate_scales": "1, 2, 4"})
    assert response.status_code == 302, response.content.decode()[-2000:]
    exp = Experiment.objects.get(name="ramp")
    assert (exp.capacity_rate_scales, exp.capacity_seconds) == ([1.0, 2.0, 4.0], 10.0)


def test_the_results_table_shows_capacity_only_when_measured(operator_client: Client) -> None:
    exp = finished_experiment()
    assert 'data-figure="capacity"' not in operator_client.get(f"/experiments/{exp.pk}/").content.decode()
    Experiment.objects.filter(pk=exp.pk).update(capacity_rate_scales=[1, 2])
    exp.arms.update(capacity=1.5)
    html = operator_client.get(f"/experiments/{exp.pk}/").content.decode()
    assert html.count('data-figure="capacity"') == exp.arms.count() and "serving capacity" in html


@pytest.mark.django_db(transaction=True)
def test_progress_is_pushed_to_the_open_page() -> None:
    workload = Workload.from_scenario(name="lt", scenario="burst", rate=1.0, duration_seconds=30)
    exp = Experiment.create(name="live", workload=workload, workers=[lab_worker()])
    viewer = make_user(Role.VIEWER)

    async def scenario() -> str:
        comm = socket(f"/ws/experiments/{exp.pk}/", viewer)
        connected, _ = await comm.connect()
        assert connected
        await database_sync_to_async(
            lambda: Experiment.objects.get(pk=exp.pk).set_progress(
                stage="repeat 1 of 1", arm=2, num_arms=5, arm_name="chunk-256", seconds_left=42
            )
        )()
        message = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return message

    html = run(scenario)
    assert html.startswith('<div id="experiment-live" hx-swap-oob="true"')
    assert "arm 2 of 5 (chunk-256): repeat 1 of 1" in html and "42" in html


def measured_experiment(shares: dict[str, float], goodputs: dict[str, tuple[float, ...]]) -> Experiment:
    """Two arms with stored repeats that sent the workload's rate, with
    these prefix-hit shares and goodputs, finished and judged."""
    workload = Workload.from_scenario(name="lt", scenario="long-tail", rate=2.0, duration_seconds=60)
    spec = workload.workload_spec()
    arms = [
        {"name": "baseline", "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": 2048}},
        {"name": "chunk-256", "fields": {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256}},
    ]
    exp = Experiment.create(name="c", workload=workload, workers=[lab_worker()], arms=arms, duration_seconds=10)
    sent = round(spec.rate_per_second * 10)
    for arm in exp.arms.all():
        arm.results = [
            {
                "repeat": r,
                "client": {"num_requests": sent, "successful_requests": sent},
                "figures": {
                    "goodput": g,
                    "output_throughput": 100.0,
                    "client_ttft_p99": 0.1,
                    "client_tpot_p99": 0.01,
                    "client_stall_p99": 0.05,
                    "prefix_hit_share": shares[arm.name],
                    "prefix_cache_queries": 1000.0,
                },
            }
            for r, g in enumerate(goodputs[arm.name])
        ]
        arm.status = ArmStatus.SUCCEEDED
        arm.save()
    from controlplane.experiments.runner import recommendation

    Experiment.objects.filter(pk=exp.pk).update(phase=Phase.SUCCEEDED, recommendation=recommendation(exp))
    return Experiment.objects.get(pk=exp.pk)


def test_each_arm_shows_its_conditions_beside_the_workloads_and_one_far_off_is_not_comparable(
    viewer_client: Client,
) -> None:
    # The second arm found its prompts cached (98% hits against the workload's share).
    exp = measured_experiment({"baseline": None, "chunk-256": 0.98}, {"baseline": (1.0,) * 3, "chunk-256": (5.0,) * 3})
    spec = exp.workload.workload_spec()
    html = viewer_client.get(f"/experiments/{exp.pk}/").content.decode()
    table = re.search(r'<table class="grid" id="experiment-conditions">(.*?)</table>', html, re.S).group(1)
    sent = round(spec.rate_per_second * 10)
    row = re.search(r'<tr data-arm="chunk-256" class="not-comparable">(.*?)</tr>', table, re.S).group(1)
    assert f"<td data-sent>{3 * sent}</td>" in row and f"<td data-completed>{3 * sent}</td>" in row
    assert "98%" in row and "data-not-comparable" in row and "against the workload" in row
    baseline = re.search(r'<tr data-arm="baseline">(.*?)</tr>', table, re.S).group(1)
    assert "data-not-comparable" not in baseline
    assert f"{sent / 10:.3f}" in baseline  # achieved rate, requests/s
    assert f"{spec.rate_per_second:.3f}" in table  # the workload's own, beside them
    assert exp.recommendation["winner"] == "baseline" and "chunk-256" in exp.recommendation["broke"]


def test_a_tie_says_no_significant_winner_and_the_plot_says_what_backs_each_point(viewer_client: Client) -> None:
    exp = measured_experiment(
        {"baseline": None, "chunk-256": None}, {"baseline": (1.0, 1.2, 1.1), "chunk-256": (1.1, 1.1, 1.1)}
    )
    html = viewer_client.get(f"/experiments/{exp.pk}/").content.decode()
    assert 'data-outcome="no_significant_winner"' in html and "data-winner>none<" in html
    assert 'id="experiment-versus-baseline"' in html and "not told apart" in html
    sent = 3 * round(exp.workload.workload_spec().rate_per_second * 10)
    data = json.loads(re.search(r'id="experiment-plot-data">(.*?)</script>', html, re.S).group(1))
    assert data["requests"] == [sent] and data["baseline"]["requests"] == sent
    points = re.search(r'id="experiment-plot-requests">(.*?)</p>', html, re.S).group(1)
    assert f"chunk-256 {sent} over 3 repeats" in points and f"baseline {sent} over 3 repeats" in points


def test_an_experiments_arm_revisions_stay_out_of_the_profiles_list_and_the_rollout_target(
    operator_client: Client,
) -> None:
    exp = finished_experiment()
    lab = Worker.objects.get(name="lab-1").pool.desired_revision
    assert exp.profile is not None and exp.profile.revisions.count() == exp.arms.count()
    profiles = operator_client.get("/profiles/").content.decode()
    assert lab.profile.name in profiles and f"experiment-{exp.pk}" not in profiles
    from dashboards.rollouts.forms import RolloutForm

    targets = set(RolloutForm().fields["target_revision"].queryset.values_list("pk", flat=True))
    assert lab.pk in targets and not targets & {a.revision_id for a in exp.arms.all()}
    # The adopted arm is a revision of the fleet's profile: a target.
    response = operator_client.post(f"/experiments/{exp.pk}/adopt/")
    adopted = int(response["Location"].rsplit("=", 1)[1])
    assert RolloutForm().fields["target_revision"].queryset.filter(pk=adopted).exists()


def test_new_experiment_takes_the_workers_profile_as_baseline_or_the_one_picked(operator_client: Client) -> None:
    running = make_profile(prefill_mode="monolithic", max_num_batched_tokens=2048, max_num_seqs=32)
    worker, _ = enroll_worker("lab-32", pool=make_pool(revision=running))
    Worker.objects.filter(pk=worker.pk).update(state=Worker.State.READY)
    form = {
        "name": "current",
        "workload": "scenario",
        "scenario": "long-tail",
        "scenario_rate": "1",
        "capture_minutes": "15",
        "workers": [worker.name],
        "chunk_sizes": "256, 512",
        "duration_seconds": "20",
        "warmup_seconds": "5",
        "repeats": "3",
        "rate_scale": "1",
        "ttft_ms": "2000",
        "tpot_ms": "200",
    }
    assert operator_client.post("/experiments/new/", form).status_code == 302
    exp = Experiment.objects.get(name="current")
    arms = list(exp.arms.order_by("index"))
    assert arms[0].name == "baseline" and arms[0].fields == running.fields
    assert {a.fields["max_num_seqs"] for a in arms} == {32}

    exp.request_abort("tester")
    Experiment.objects.filter(pk=exp.pk).update(phase=Phase.ABORTED)
    picked = make_profile(prefill_mode="monolithic", max_num_batched_tokens=1024, max_num_seqs=4)
    html = operator_client.get("/experiments/new/").content.decode()
    assert f'<option value="{picked.pk}">' in html and f"experiment-{exp.pk}" not in html
    assert (
        operator_client.post(
            "/experiments/new/", {**form, "name": "picked", "baseline_revision": picked.pk}
        ).status_code
        == 302
    )
    arms = list(Experiment.objects.get(name="picked").arms.order_by("index"))
    assert arms[0].fields == picked.fields and {a.fields["max_num_seqs"] for a in arms} == {4}


def test_a_new_experiment_starts_from_the_overviews_objectives(operator_client: Client) -> None:
    """One TPOT default: the overview said 100 ms while New experiment said 200 ms."""
    overview = operator_client.get("/figures/").content.decode()
    form = operator_client.get("/experiments/new/").content.decode()
    service = ServiceObjectives.current()
    assert f'name="tpot_seconds" type="number" step="any" min="0.0001" value="{service.tpot_seconds}"' in overview
    for field, seconds in (("tpot_ms", service.tpot_seconds), ("ttft_ms", service.ttft_seconds)):
        match = re.search(rf'name="{field}" value="([0-9.]+)"', form)
        assert match and float(match.group(1)) == 1000 * seconds, field
