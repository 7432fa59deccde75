"""A scrape round split into shards: each a Celery task, every worker's
snapshot stored, the round's row closed by its last shard, beat's tick
skipping while any shard runs, and a slow worker holding nobody past the
timeout. The workers are one small HTTP server serving a page per path
(tests/controlplane/metrics/pages.py), one path answering only after 5 s."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import time_machine
from django.utils import timezone

from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import catalogue, tasks
from controlplane.metrics.models import ScrapeRound, ScrapeStatus, Snapshot
from controlplane.metrics.scrape import round_horizon, round_in_flight, run_shard, start_round
from tests.conftest import RUN_ID, control_plane_env
from tests.controlplane.metrics.pages import Page
from tests.support import PYTHON, Process, running

SLOW_SECONDS = 5.0
TIMEOUT_SECONDS = 1.0
SHARD_SIZE = 2


def page_text() -> str:
    counters = {name: float(10 + k) for k, name in enumerate(catalogue.COUNTERS)}
    return Page(counters=counters, gauges={"chunkpilot:memory_recent_peak_bytes": 1.5e9}).text()


class Pages:
    """``GET /<name>/metrics``: a page; ``/slow/metrics`` only after SLOW_SECONDS."""

    def __init__(self) -> None:
        self.slow_answered = threading.Event()
        self.release = threading.Event()  # set at teardown: the slow handler ends early
        text = page_text().encode()
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/slow/"):
                    pages.release.wait(SLOW_SECONDS)
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                except OSError:
                    pass  # the scraper gave up on it
                if self.path.startswith("/slow/"):
                    pages.slow_answered.set()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Pages:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pages() -> Iterator[Pages]:
    with Pages() as p:
        yield p


@pytest.fixture
def shards(settings: Any) -> None:
    settings.SCRAPE_SHARD_SIZE = SHARD_SIZE
    settings.SCRAPE_TIMEOUT_SECONDS = TIMEOUT_SECONDS


@pytest.fixture
def celery(transactional_db: Any, tmp_path: Path) -> Iterator[Process]:
    """A real Celery worker (prefork, two processes: shards run side by side)
    on this run's queue, with this module's shard size and timeout."""
    from django.conf import settings

    argv = [PYTHON, "-m", "celery", "-A", "controlplane", "worker", "--concurrency", "2", "--loglevel", "INFO"]
    argv += ["--without-gossip", "--without-mingle", "-Q", settings.CELERY_TASK_DEFAULT_QUEUE]
    argv += ["-n", f"shards-{RUN_ID}-{uuid.uuid4().hex[:4]}@%h"]
    env = control_plane_env(SCRAPE_SHARD_SIZE=str(SHARD_SIZE), SCRAPE_TIMEOUT_SECONDS=str(TIMEOUT_SECONDS))
    with running(argv, env=env, log_path=tmp_path / "celery.log") as proc:
        proc.wait_for_output("ready.", timeout=60)
        yield proc


def make_fleet(base: str, names: list[str]) -> dict[str, Worker]:
    pool = Pool.objects.create(name="p")
    return {n: Worker.objects.create(name=n, url=f"{base}/{n}", pool=pool, state=WorkerState.READY) for n in names}


def wait_finished(scrape_round: ScrapeRound, celery: Process) -> ScrapeRound:
    deadline = time.monotonic() + 60
    while True:
        scrape_round.refresh_from_db()
        if scrape_round.finished_at is not None:
            return scrape_round
        assert time.monotonic() < deadline, celery.output()[-3000:]
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.usefixtures("shards")
def test_a_round_over_more_workers_than_the_shard_size_runs_as_several_tasks_and_stores_every_snapshot(
    pages: Pages, celery: Process
) -> None:
    fleet = make_fleet(pages.url, [f"w{i}" for i in range(5)])

    reply = tasks.scrape()  # beat's tick: runs the first shard itself, queues two
    assert reply["shards"] == 3 and reply["targets"] == 5
    scrape_round = wait_finished(ScrapeRound.objects.get(), celery)

    assert (scrape_round.num_shards, scrape_round.num_shards_done) == (3, 3)
    assert (scrape_round.num_targets, scrape_round.num_failed) == (5, 0)
    ran = [line for line in celery.output().splitlines() if "metrics.scrape_shard" in line and "succeeded" in line]
    assert len(ran) == 2, "two shards ran as Celery tasks of their own"
    for worker in fleet.values():
        snapshot = Snapshot.objects.get(target__worker_name=worker.name)
        assert snapshot.ts == scrape_round.started_at, "every shard stamps the round's one time"
        assert ScrapeStatus.objects.get(worker=worker).up
    assert round_in_flight(timezone.now()) is None


@pytest.mark.slow
@pytest.mark.usefixtures("shards")
def test_a_slow_worker_delays_no_other_snapshot_past_the_timeout(pages: Pages, celery: Process) -> None:
    fleet = make_fleet(pages.url, ["slow", "a", "b", "c", "d"])

    tasks.scrape()
    scrape_round = wait_finished(ScrapeRound.objects.get(), celery)

    assert not pages.slow_answered.is_set(), "the round ended before the slow worker's answer: nobody waited for it"
    assert (scrape_round.num_shards, scrape_round.num_failed) == (3, 1)
    status = {s.worker.name: s for s in ScrapeStatus.objects.select_related("worker")}
    assert not status["slow"].up and status["slow"].last_error == f"timed out after {TIMEOUT_SECONDS:g}s"
    for name in ("a", "b", "c", "d"):
        assert status[name].up and status[name].last_duration_seconds <= TIMEOUT_SECONDS
        assert Snapshot.objects.filter(target__worker=fleet[name]).count() == 1
    assert not Snapshot.objects.filter(target__worker=fleet["slow"]).exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("shards")
def test_a_sharded_round_is_in_flight_until_its_last_shard_ends() -> None:
    make_fleet("http://192.0.2.1:9", [f"w{i}" for i in range(5)])  # never asked here
    now = timezone.now()
    scrape_round, worker_ids = start_round(now)
    assert sorted(len(ids) for ids in worker_ids) == [1, 2, 2]
    assert sorted(pk for ids in worker_ids for pk in ids) == sorted(Worker.objects.values_list("pk", flat=True))

    assert round_in_flight(now) == scrape_round
    assert tasks.scrape()["skipped"] == 1
    assert not scrape_round.finish_shard(0, now)
    assert not scrape_round.finish_shard(2, now)
    assert round_in_flight(now) == scrape_round, "one shard still runs"
    assert tasks.scrape()["skipped"] == 1
    assert scrape_round.finish_shard(1, now + timedelta(seconds=2)), "the last shard finishes the round"
    assert round_in_flight(now) is None
    assert scrape_round.finished_at == now + timedelta(seconds=2) and scrape_round.num_failed == 3
    assert not scrape_round.finish_shard(0, now + timedelta(seconds=3)), "finished once"
    assert ScrapeRound.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("shards")
def test_a_shard_that_starts_after_its_rounds_time_skips_its_workers_and_closes_the_round() -> None:
    make_fleet("http://192.0.2.1:9", ["w0", "w1", "w2"])
    scrape_round, worker_ids = start_round()
    with time_machine.travel(timezone.now() + round_horizon() + timedelta(seconds=1)):
        for ids in worker_ids:
            run_shard(scrape_round.pk, ids)  # no fetch: the unroutable address would time out
    scrape_round.refresh_from_db()
    assert scrape_round.finished_at is not None and scrape_round.num_shards_done == scrape_round.num_shards == 2
    assert scrape_round.num_failed == 3, "the skipped workers count as not scraped"
    assert not ScrapeStatus.objects.exists(), "a late control plane does not mark workers down"
    assert run_shard(scrape_round.pk + 1, worker_ids[0]) is None, "a round gone: nothing to do"


@pytest.mark.django_db
def test_a_tick_over_an_empty_fleet_makes_a_finished_round() -> None:
    assert tasks.scrape() == {"targets": 0, "failed": 0, "shards": 0}
    assert ScrapeRound.objects.get().finished_at is not None
