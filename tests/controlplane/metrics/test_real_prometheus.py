"""Debian's Prometheus with the shipped config and rules, scraping a real
fleet: two reference workers on the tiny model (a chunked stable pool, a
monolithic canary), found through the control plane's HTTP service
discovery, under loadgen traffic, while the control plane scrapes them too.

Over one window, Prometheus's answers for the four-figure panel, ITL (TBT)
and stalls (the shipped dashboard's expressions, as Grafana sends them) and
Chunkpilot's own (``/api/v1/metrics/query``) agree per cohort: ratios within
2%, quantiles within one histogram bucket.

Why they can differ at all: the two scrape the same counters at different
moments, so each sees a window's edges at its own samples and extrapolates
to them by its own factor. The window opens and closes on idle workers
(traffic starts after it and ends before its end), so every counter of a
request is in both; what is left is the extrapolation factor (the same for
every series of a worker, so it cancels in each cohort's ratios and
quantiles, which have one worker each) and the integrals of memory and
fragmentation over the idle edges, which the two cover to within a scrape
interval.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import math
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.management import call_command
from django.db import connection

from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RoutingPool, RoutingTable
from controlplane.metrics import deploy, scrape
from tests.monitoring import DEPLOY, prometheus, prometheus_config, short_rules
from tests.support import PYTHON, child_env
from tests.workers.server.support import worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
logging.getLogger("httpx").setLevel(logging.WARNING)

# Short against the window: the two scrapers' edges differ by up to one
# interval, which is what the time-weighted means can differ by.
SCRAPE_INTERVAL_SECONDS = 0.5
TRAFFIC_SECONDS = 40
TOLERANCE = 0.02
BASE = {"max_num_batched_tokens": 256, "max_num_seqs": 4, "block_size": 32, "kv_cache_bytes": 32 << 20}
PROFILES = {
    "stable": {**BASE, "prefill_mode": "chunked", "long_prefill_token_threshold": 64},
    "canary": {**BASE, "prefill_mode": "monolithic", "max_num_batched_tokens": 1024},
}
# Each compared figure: the dashboard panel and target that draw it, and the
# histogram it is a quantile of (None: a ratio).
COMPARED: dict[str, tuple[str, str, str | None]] = {
    "ttft_p99": ("TTFT P99", "A", "chunkpilot:time_to_first_token_seconds"),
    "memory_peak_to_mean": ("Memory peak/mean", "A", None),
    "prefill_wait_mean": ("Prefill wait (mean, P99)", "A", None),
    "prefill_wait_p99": ("Prefill wait (mean, P99)", "B", "chunkpilot:prefill_chunk_wait_seconds"),
    "kv_fragmentation": ("KV fragmentation", "A", None),
    "itl_p99": ("ITL P99", "A", "chunkpilot:inter_token_latency_seconds"),
    "stall_p99": ("Stalls P99 (largest gap per request)", "A", "chunkpilot:request_max_gap_seconds"),
}


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana/chunkpilot.json").read_text())


def panel_expr(title: str, ref: str, *, group: str, window: str) -> str:
    panel = next(p for p in dashboard()["panels"] if p["title"] == title)
    target = next(t for t in panel["targets"] if t["refId"] == ref)
    return str(target["expr"]).replace("$group", group).replace("$window", window).replace("$pool", ".*")


class Scraper:
    """The control plane's own scrape rounds on a fixed clock, as beat runs them."""

    def __init__(self, interval: float):
        self.interval = interval
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                scrape.scrape_fleet()
                self.rounds += 1
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            connection.close()

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def token(username: str, role: str) -> str:
    out = io.StringIO()
    call_command("createapitoken", username, role=role, create=True, stdout=out)
    return out.getvalue().strip()


def loadgen(url: str, seed: int) -> subprocess.Popen[str]:
    argv = [
        PYTHON,
        "-m",
        "workers",
        "loadgen",
        "--url",
        url,
        "--scenario",
        "long-tail",
        "--rate",
        "1.5",
        "--duration",
        str(TRAFFIC_SECONDS),
        "--seed",
        str(seed),
        "--json",
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met after {timeout}s"
        time.sleep(0.25)


def bucket_of(value: float, bounds: list[float]) -> int:
    """The index of the bucket (upper bounds, +Inf last) that holds a value."""
    return bisect.bisect_left(bounds, value)


@pytest.fixture
def fleet(tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Two reference workers registered in a routing table: cohort → URL."""
    table = RoutingTable.objects.create(model="tiny")
    urls = {}
    extra = ["--max-model-len", "1024", "--served-model-name", "tiny"]
    with (
        worker(tiny_model, tmp_path / "stable.log", profile=json.dumps(PROFILES["stable"]), extra=extra) as (a, _),
        worker(tiny_model, tmp_path / "canary.log", profile=json.dumps(PROFILES["canary"]), extra=extra) as (b, _),
    ):
        for cohort, url in (("stable", a), ("canary", b)):
            pool = Pool.objects.create(name=f"prom-{cohort}")
            RoutingPool.objects.create(table=table, pool=pool, role=cohort, weight_bp=5000)
            Worker.objects.create(name=f"prom-{cohort}-worker", url=url, pool=pool, state=WorkerState.READY)
            urls[cohort] = url
        yield urls


def test_prometheus_with_the_shipped_config_agrees_with_chunkpilot_on_the_figures(
    web: str, fleet: dict[str, str], tmp_path: Path
) -> None:
    viewer = token("prometheus", "viewer")
    api = httpx.Client(base_url=f"{web}/api/v1", headers={"Authorization": f"Token {viewer}"}, timeout=30)
    # The shipped rules, evaluated every scrape rather than every 30 s, so
    # that their health is known within the test.
    files = {"rules.yml": short_rules(), deploy.TOKEN_FILE: viewer}
    config = prometheus_config(control_plane=web, scrape_interval=f"{SCRAPE_INTERVAL_SECONDS * 1000:.0f}ms")
    with Scraper(SCRAPE_INTERVAL_SECONDS) as scraper, prometheus(tmp_path / "prometheus", config, files) as prom:
        # Service discovery labels the workers as the control plane groups them.
        def workers_up() -> list[dict[str, Any]] | None:
            found = prom.active_targets(deploy.WORKERS_JOB)
            return found if len(found) == 2 and all(t["health"] == "up" for t in found) else None

        targets = wait_for(workers_up, timeout=60, what="both workers scraped by Prometheus")
        assert {(t["labels"]["cohort"], t["labels"]["pool"]) for t in targets} == {
            ("stable", "prom-stable"),
            ("canary", "prom-canary"),
        }
        wait_for(
            lambda: [t for t in prom.active_targets(deploy.CONTROL_PLANE_JOB) if t["health"] == "up"],
            timeout=30,
            what="the control plane's /metrics scraped with the viewer's token",
        )
        time.sleep(6 * SCRAPE_INTERVAL_SECONDS)  # idle samples at the window's start

        window_start = time.time() - 3 * SCRAPE_INTERVAL_SECONDS
        runs = [loadgen(fleet["stable"], 1), loadgen(fleet["canary"], 2)]
        summaries = []
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, err[-3000:]
            summaries.append(json.loads(out)["summary"])
        assert all(s["num_requests"] >= 10 and s["failed_requests"] == 0 for s in summaries), summaries
        time.sleep(8 * SCRAPE_INTERVAL_SECONDS)  # idle samples at its end, in both
        window = f"{math.ceil(time.time() - window_start)}s"

        report, disagreements = [], []
        for figure, (title, ref, histogram) in COMPARED.items():
            ours = api.get("/metrics/query/", params={"figure": figure, "window": window, "group_by": "cohort"})
            assert ours.status_code == 200, ours.text
            # The same window: Prometheus evaluated at the instant Chunkpilot was.
            at = datetime.fromisoformat(ours.json()["at"]).timestamp()
            theirs = prom.by("cohort", panel_expr(title, ref, group="cohort", window=window), at=at)
            for cohort in ("stable", "canary"):
                a, b = ours.json()["values"][cohort], theirs.get(cohort)
                assert a is not None and b is not None and math.isfinite(b), (figure, cohort, a, b)
                if histogram is None:
                    agree = abs(a - b) <= TOLERANCE * abs(a)
                else:
                    bounds = sorted(float(le) for le in prom.by("le", f"count by (le) ({histogram}_bucket)"))
                    agree = abs(bucket_of(a, bounds) - bucket_of(b, bounds)) <= 1
                line = (
                    f"{figure} {cohort}: chunkpilot {a:.6g}, prometheus {b:.6g}, difference {abs(a - b) / abs(a):.2e}"
                )
                report.append(line)
                if not agree:
                    disagreements.append(line)
        print(f"\nwindow {window}, {scraper.rounds} control-plane scrape rounds:\n" + "\n".join(report))
        assert not disagreements, disagreements

        # Every series the dashboard reads is one the workers serve, and
        # every panel draws both cohorts from them.
        served = set(prom.api("label/__name__/values", **{"match[]": f'{{job="{deploy.WORKERS_JOB}"}}'}))
        for panel in dashboard()["panels"]:
            for target in panel.get("targets", []):
                assert deploy.metric_names(target["expr"]) <= served, (panel["title"], target["expr"])
                expr = str(target["expr"]).replace("$group", "cohort").replace("$window", window).replace("$pool", ".*")
                assert set(prom.by("cohort", expr)) == {"stable", "canary"}, (panel["title"], expr)
        # The shipped rules evaluate on real series without error, and the
        # four-figure panel is recorded per cohort.
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == sum(len(g["rules"]) for g in deploy.prometheus_rules()["groups"])
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        for figure in ("ttft_p99", "memory_peak_to_mean", "prefill_wait_p99", "kv_fragmentation"):
            assert set(prom.by("cohort", f"chunkpilot:{figure}:{deploy.RULE_WINDOW}")) == {"stable", "canary"}
