"""Headless Chromium against a real ASGI server, a real Celery worker and a
real reference worker on the tiny model (a lab worker, its agent talking to
that server): an operator starts an experiment from "New experiment",
watches its progress arm by arm without reloading, and sees the plot, each
arm's achieved rate and prefix-hit share beside the workload's, and the
recommendation when it ends. The sweep is a tie built to be one: the pool
runs monolithic on a 512-token model and the one chunked arm caps chunks at
512, so it can never split a prompt; the page must say "no significant
winner" rather than crown either by the clock."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from controlplane.accounts.roles import Role
from controlplane.experiments.models import Experiment
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.profiles.models import Profile
from tests.dashboards.support import not_reloaded, sign_in, wait_for_socket
from tests.support import PYTHON, child_env, free_port, running, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_an_operator_starts_an_experiment_watches_it_and_sees_plot_and_recommendation(
    page: Any, web: str, celery_worker: Any, tiny_model: Path, tmp_path: Path
) -> None:
    profile = Profile.objects.create(name="lab", engine_kind="reference")
    pool = Pool.objects.create(name="lab")
    pool.set_desired_revision(
        profile.add_revision({"prefill_mode": "monolithic", "max_num_batched_tokens": 512, "max_num_seqs": 8})
    )
    _, token = EnrollmentToken.issue("lab", pool=pool, max_uses=1)
    port = free_port()
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
        "512",
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--control-plane",
        web,
        "--enroll-token",
        token,
        "--name",
        "lab-1",
        "--label",
        "demo_pool=lab",
        "--advertise-url",
        f"http://127.0.0.1:{port}",
        "--state-file",
        str(tmp_path / "lab.state"),
    ]
    with running(argv, env=child_env(), log_path=tmp_path / "lab.log") as worker:
        wait_until(
            lambda: Worker.objects.filter(name="lab-1", state=Worker.State.READY).exists(),
            timeout=180,
            what="the lab worker ready",
            detail=worker.output,
        )
        sign_in(page, web, Role.OPERATOR, "/experiments/new/")
        form = page.locator("#experiment-form")
        expect(form.locator('select[name="workers"] option[value="lab-1"]')).to_have_attribute("selected", "")
        form.locator('select[name="workload"]').select_option("scenario")
        form.locator('select[name="scenario"]').select_option("long-tail")
        for name, value in (
            ("name", "browser sweep"),
            ("chunk_sizes", "512"),
            ("scenario_rate", "2"),
            ("repeats", "2"),
            ("duration_seconds", "4"),
            ("warmup_seconds", "0"),
            ("ttft_ms", "60000"),
            ("tpot_ms", "10000"),
        ):
            form.locator(f'[name="{name}"]').fill(value)
        form.locator('button[type="submit"]').click()
        page.wait_for_url(lambda url: "/experiments/" in url and url.rstrip("/").split("/")[-1].isdigit())
        exp = Experiment.objects.get(name="browser sweep")
        wait_for_socket(page, f"/ws/experiments/{exp.pk}/")
        live = page.locator("#experiment-live")
        # progress, pushed arm by arm
        expect(page.locator("#experiment-progress")).to_contain_text("arm 2 of 2", timeout=240_000)
        expect(live).to_have_attribute("data-phase", "succeeded", timeout=300_000)
        assert not_reloaded(page), "progress and results arrived in place"
        expect(page.locator('#experiment-results tr[data-status="succeeded"]')).to_have_count(2)
        expect(page.locator("#experiment-plot")).to_have_attribute("data-points", "1")
        expect(page.locator("#experiment-plot canvas")).to_have_count(1)
        expect(page.locator("#experiment-plot-requests [data-point]")).to_have_count(2)
        for arm in ("baseline", "chunk-512"):
            row = page.locator(f'#experiment-conditions tr[data-arm="{arm}"]')
            expect(row.locator("[data-rate]")).to_have_text(re.compile(r"^\d+\.\d{3}$"))
            expect(row.locator("[data-prefix]")).to_have_text(re.compile(r"^\d+%$"))
            expect(row.locator("[data-not-comparable]")).to_have_count(0)
        recommendation = page.locator("#experiment-recommendation")
        expect(recommendation).to_be_visible()
        rec = Experiment.objects.get(pk=exp.pk).recommendation
        assert rec["outcome"] == "no_significant_winner", rec["reasons"]
        expect(recommendation.locator("[data-outcome]")).to_have_text("no significant winner")
        expect(recommendation.locator("[data-winner]")).to_have_text("none")
        worker_row = Worker.objects.get(name="lab-1")
        assert (worker_row.desired_revision_id, worker_row.cordoned) == (None, False)
