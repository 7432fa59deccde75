"""``bench_fleet``: its arithmetic (CPU time per process tree, the cost
model per unit of work), and its whole machinery at a small scale: four
simulated workers, every figure in the report, one of them killed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from controlplane.bench import fleet
from controlplane.bench.management.commands.bench_fleet import REPORT_ROWS


def size(workers: int, *, heartbeats: int, scrapes: int, web: float, celery: float) -> fleet.SizeFigures:
    return fleet.SizeFigures(
        workers=workers,
        measured_seconds=60.0,
        scrape_interval_seconds=5.0,
        scrape_timeout_seconds=4.0,
        alert_cycle_ms=10.0,
        alert_interval_seconds=15.0,
        num_heartbeats=heartbeats,
        num_worker_scrapes=scrapes,
        num_requests=100,
        cpu_seconds={"web": web, "celery": celery, "beat": 0.6, "gateway": 1.0},
        rows_by_table={"fleet_worker": heartbeats, "metrics_snapshot": scrapes, "metrics_rollup": scrapes},
        database_bytes_per_minute=scrapes * 1000.0,
    )


def test_the_cost_model_charges_work_done_so_a_starved_fleet_is_not_cheaper() -> None:
    # 100 workers heartbeating every 2 s for a minute: 3000 heartbeats at 3 ms each;
    # 1200 scrapes at 10 ms each. The starved run did half the work for half the CPU.
    full = fleet.CostModel.fit(
        [size(100, heartbeats=3000, scrapes=1200, web=9.0, celery=12.0)], heartbeat_interval_seconds=2
    )
    starved = fleet.CostModel.fit(
        [size(100, heartbeats=1500, scrapes=600, web=4.5, celery=6.0)], heartbeat_interval_seconds=2
    )
    for model in (full, starved):
        assert model.web_seconds_per_heartbeat == pytest.approx(0.003)
        assert model.celery_seconds_per_scrape == pytest.approx(0.010)
        p = model.project(1000)
        assert p.cores["web"] == pytest.approx(500 * 0.003)  # 500 heartbeats a second
        assert p.cores["celery"] == pytest.approx(200 * 0.010)  # 200 scrapes a second
        assert p.cores["beat"] == pytest.approx(0.01)
        assert p.rows_per_second == pytest.approx(500 * 1 + 200 * 2)
        assert p.scrape_round_cpu_seconds == pytest.approx(10.0)
        assert model.project(1000, heartbeat_interval_seconds=10).cores["web"] == pytest.approx(100 * 0.003)


def test_the_first_loop_to_miss_is_the_one_with_the_smallest_fleet() -> None:
    model = fleet.CostModel.fit(
        [size(100, heartbeats=3000, scrapes=1200, web=9.0, celery=12.0)], heartbeat_interval_seconds=2
    )
    misses = dict(model.misses())
    assert misses["one Celery process's share of a scrape round reaches the scrape timeout"] == pytest.approx(
        4.0 / 0.010
    )
    assert misses["one web process's heartbeats fill a core"] == pytest.approx(2.0 / 0.003)
    assert misses["one alert cycle reaches ALERT_EVAL_INTERVAL"] == pytest.approx(15.0 / 0.0001)
    assert model.misses()[0][0] == "one Celery process's share of a scrape round reaches the scrape timeout"


def test_a_heartbeat_interval_scaled_to_the_fleet_moves_the_web_tier_s_limit() -> None:
    # 3 ms per heartbeat; at a fixed 2 s one web process is full at 667 workers. Told
    # intervals that hold the fleet near 200 heartbeats a second up to a 15-s ceiling,
    # it is full only once the ceiling is reached and workers / 15 s reaches 333 a second.
    sizes = [size(100, heartbeats=3000, scrapes=1200, web=9.0, celery=12.0)]
    fixed = fleet.CostModel.fit(sizes, heartbeat_interval_seconds=2)
    scaled = fleet.CostModel.fit(
        sizes, heartbeat_interval_seconds=2, heartbeat_target_rate=200, heartbeat_interval_max_seconds=15
    )
    assert dict(fixed.misses())["one web process's heartbeats fill a core"] == pytest.approx(2.0 / 0.003)
    assert dict(scaled.misses())["one web process's heartbeats fill a core"] == pytest.approx(5000, abs=10)
    assert scaled.heartbeat_interval_at(400) == 2 and scaled.heartbeat_interval_at(1000) == 5
    assert scaled.project(1000).cores["web"] == pytest.approx(200 * 0.003)  # 1000 workers every 5 s
    assert scaled.project(1000, heartbeat_interval_seconds=2).cores["web"] == pytest.approx(500 * 0.003)


def test_cpu_seconds_sum_every_process_of_a_session(tmp_path: Path) -> None:
    ticks = fleet.CLOCK_TICKS

    def stat(pid: int, session: int, utime: int, stime: int) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", "1", str(session), str(session)] + ["0"] * 7 + [str(utime), str(stime)] + ["0"] * 30
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (odd) name) " + " ".join(fields))

    stat(10, 10, ticks, ticks)  # the leader: 2 s
    stat(11, 10, 2 * ticks, 0)  # its child: 2 s
    stat(20, 20, 5 * ticks, 0)  # another session
    (tmp_path / "self").mkdir()
    assert fleet.session_cpu_seconds([10, 30], proc=tmp_path) == {10: 4.0, 30: 0.0}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_small_fleet_run_reports_every_figure_and_the_kill(tmp_path: Path) -> None:
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    env: dict[str, Any] = {
        **os.environ,
        "DATABASE_URL": f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
    }
    out = tmp_path / "figures.json"
    argv = [sys.executable, "manage.py", "bench_fleet", "--workers", "4", "--duration", "12", "--settle", "2"]
    argv += ["--per-process", "1", "--kill-fraction", "0.25", "--aborts", "2", "--json", str(out)]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    payload = json.loads(out.read_text())
    figures = payload["sizes"][0]
    missing = [name for name in fleet.FIGURES if not math.isfinite(figures[name])]
    assert not missing, f"figures without a value: {missing}"
    assert figures["workers"] == 4 and figures["num_canary_workers"] == 2
    # two rollouts and aborts: the P99 is the slower of the two acks
    assert len(figures["abort_acked_samples_ms"]) == 2
    assert figures["abort_acked_ms"] == max(figures["abort_acked_samples_ms"])
    assert figures["num_heartbeats"] > 0 and figures["num_worker_scrapes"] > 0
    assert set(figures["cpu_seconds"]) == set(fleet.PROCESSES)
    for label, _ in REPORT_ROWS:
        assert label in run.stdout
    assert "where one process of each loop misses its interval" in run.stdout
    assert "10000 workers" in run.stdout
    fault = payload["fault"]
    assert (fault["killed_workers"], fault["fleet"]) == (1, 4), "one worker's process of four killed"
    assert fault["scrape_rounds"] > 0 and math.isfinite(fault["dead_all_marked_unhealthy_seconds"])
    assert "workers killed at once" in run.stdout
