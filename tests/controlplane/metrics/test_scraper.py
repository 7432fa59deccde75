"""The scraper against real worker servers (``python -m workers serve`` on the
tiny model), beside one that refuses connections and one that accepts and
never answers: the live ones are stored with the cohort of their pool, the
silent ones are marked down, and nobody waits for them past the timeout."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RoutingPool, RoutingTable
from controlplane.metrics import query, scrape
from controlplane.metrics.models import (
    Rollup,
    ScrapeRound,
    ScrapeStatus,
    SeriesLayout,
    Snapshot,
    Target,
    unpack,
)
from tests.support import free_port
from tests.workers.server.support import worker

pytestmark = [pytest.mark.slow]

PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 256,
    "long_prefill_token_threshold": 64,
    "max_num_seqs": 4,
    "block_size": 32,
    "kv_cache_bytes": 32 << 20,
}
REQUESTS_PER_WORKER = 4


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: Any) -> Iterator[list[str]]:
    """Two real reference workers for the whole module."""
    logs = tmp_path_factory.mktemp("scraped-workers")
    extra = ["--max-model-len", "1024", "--served-model-name", "tiny"]
    with (
        worker(tiny_model, logs / "a.log", profile=json.dumps(PROFILE), extra=extra) as (a, _),
        worker(tiny_model, logs / "b.log", profile=json.dumps(PROFILE), extra=extra) as (b, _),
    ):
        yield [a, b]


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A server that accepts connections and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    listener.close()


def fleet(servers: list[str], hung_url: str) -> dict[str, Worker]:
    stable_pool, canary_pool = Pool.objects.create(name="stable-pool"), Pool.objects.create(name="canary-pool")
    table = RoutingTable.objects.create(model="tiny")
    RoutingPool.objects.create(table=table, pool=stable_pool, role="stable", weight_bp=9000)
    RoutingPool.objects.create(table=table, pool=canary_pool, role="canary", weight_bp=1000)

    def make(name: str, url: str, pool: Pool, state: WorkerState = WorkerState.READY) -> Worker:
        return Worker.objects.create(name=name, url=url, pool=pool, state=state)

    return {
        "stable": make("real-stable", servers[0], stable_pool),
        "canary": make("real-canary", servers[1], canary_pool),
        "refused": make("refused", f"http://127.0.0.1:{free_port()}", stable_pool),
        "hung": make("hung", hung_url, stable_pool),
        "offline": make("offline", "http://192.0.2.1:9", stable_pool, WorkerState.OFFLINE),  # not asked at all
    }


def complete(base: str, n: int) -> None:
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(n):
            reply = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": f"count {i}:", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            )
            assert reply.status_code == 200, reply.text


def totals(target: Target, key: str) -> list[float]:
    layout = SeriesLayout.layout_by_id(target.layout_id)
    rows = Snapshot.objects.filter(target=target).order_by("ts").values_list("values", flat=True)
    return [float(unpack(blob)[layout.index[key]]) for blob in rows]


@pytest.mark.django_db
def test_scraper_stores_real_workers_and_marks_silent_ones_down_without_waiting(
    servers: list[str], hung_url: str, settings: Any
) -> None:
    settings.SCRAPE_TIMEOUT_SECONDS = 1.0
    fleet(servers, hung_url)
    t0 = timezone.now()

    started = time.monotonic()
    first = scrape.scrape_fleet(now=t0)
    assert time.monotonic() - started < 1.0 + 2.0, "the hung worker delayed the round past its timeout"
    for base in servers:
        complete(base, REQUESTS_PER_WORKER)
    second = scrape.scrape_fleet(now=t0 + timedelta(seconds=5))

    assert (first.num_targets, first.num_failed) == (4, 2) and (second.num_targets, second.num_failed) == (4, 2)
    status = {s.worker.name: s for s in ScrapeStatus.objects.select_related("worker")}
    assert status["real-stable"].up and status["real-canary"].up
    assert not status["refused"].up and status["refused"].num_consecutive_failures == 2
    assert not status["hung"].up and "timed out" in status["hung"].last_error
    assert "offline" not in status

    targets = {t.worker_name: t for t in Target.objects.all()}
    assert set(targets) == {"real-stable", "real-canary"}
    assert (targets["real-stable"].cohort, targets["real-canary"].cohort) == ("stable", "canary")
    assert (targets["real-stable"].pool_name, targets["real-canary"].pool_name) == ("stable-pool", "canary-pool")
    for name in ("real-stable", "real-canary"):
        count = totals(targets[name], "vllm:time_to_first_token_seconds_count")
        assert count[1] - count[0] == REQUESTS_PER_WORKER
        tokens = totals(targets[name], "chunkpilot:step_tokens_total{kind=decode}")
        assert tokens[1] > tokens[0]
    assert Snapshot.objects.count() == 4 and Rollup.objects.count() >= 2

    now = t0 + timedelta(seconds=5)
    rates = query.query("requests_per_second", 60, "cohort", now=now)
    assert set(rates) == {"stable", "canary"} and all(v is not None and v > 0 for v in rates.values())
    ttft = query.query("ttft_p99", 60, "cohort", now=now)
    assert all(v is not None and v > 0 for v in ttft.values())
    assert query.query("kv_fragmentation", 60, "worker", now=now)["real-canary"] is not None


@pytest.mark.django_db(transaction=True)
def test_the_beat_task_scrapes_on_a_real_celery_worker(servers: list[str], celery_worker: Any) -> None:
    from controlplane.metrics import tasks

    pool = Pool.objects.create(name="p")
    Worker.objects.create(name="real-a", url=servers[0], pool=pool, state=WorkerState.READY)
    tasks.scrape.delay()
    deadline = time.monotonic() + 30
    while not ScrapeRound.objects.filter(finished_at__isnull=False).exists():
        assert time.monotonic() < deadline, celery_worker.output()[-3000:]
        time.sleep(0.2)
    assert ScrapeStatus.objects.get(worker__name="real-a").up
    assert Snapshot.objects.filter(target__worker_name="real-a").count() == 1
