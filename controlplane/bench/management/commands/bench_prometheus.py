"""``python manage.py bench_prometheus``: the four-figure panel on the
Prometheus backend at fleet scale, beside the database backend.

Writes the same synthetic fleet ``bench_metrics`` stores (50 workers x 24 h of
every series a reference worker serves, labelled as the control plane's
service discovery labels them) as OpenMetrics, turns it into TSDB blocks
with ``promtool tsdb create-blocks-from openmetrics``, starts Debian's
Prometheus on those blocks, and times the panel page (server time: view +
Prometheus queries + template) with ``METRICS_BACKEND=prometheus``, then,
with ``--database``, ``bench_metrics``'s database run of the same panel in
the same process, for the ratio.

The samples run from 24 h ago to ``--lead-minutes`` ahead, so that the page's
newest windows (ending now) fall inside the data however long generation
takes. ``--interval`` is the scrape interval the data pretends (the shipped
config scrapes workers every 5 s; the default, 15 s, is Prometheus's own
default and keeps the file a few GB smaller).

Generation takes about 13 minutes on two cores. ``--dir D --reuse`` times
the blocks an earlier run left in ``D`` instead (made with a ``--lead-minutes``
long enough to still cover now), so that two versions of the panel can be
timed one after the other on the same data.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from django.core.management.base import CommandError
from django.test import override_settings
from django.utils import timezone

from controlplane.bench.management.commands import bench_metrics
from controlplane.metrics import deploy, figures, query

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _split(key: str) -> tuple[str, str]:
    """A layout key (``name{k=v}``) as a series name and its label text (``k="v"``)."""
    if "{" not in key:
        return key, ""
    name, rest = key.split("{", 1)
    labels = ",".join(f'{k}="{v}"' for k, v in (pair.split("=", 1) for pair in rest.rstrip("}").split(",")))
    return name, labels


class Command(bench_metrics.Command):
    help = "Benchmark the four-figure panel on the Prometheus backend: 50 workers x 24 h backfilled with promtool."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.set_defaults(interval=15.0)
        parser.add_argument("--lead-minutes", type=float, default=20.0, help="how far past now the data runs")
        parser.add_argument("--database", action="store_true", help="also time the database backend (bench_metrics)")
        parser.add_argument(
            "--dir", default="", help="where the OpenMetrics file and the TSDB go (default: a temp dir)"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        for binary in (PROMETHEUS, PROMTOOL):
            if not Path(binary).exists():
                raise CommandError(f"{binary} is missing: apt-get install prometheus")
        work = Path(opts["dir"] or tempfile.mkdtemp(prefix="bench-prometheus-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            self._prometheus_run(work, opts)
            if opts["database"]:
                with override_settings(METRICS_BACKEND="database"):
                    self.stdout.write("\n-- the database backend (bench_metrics) --")
                    super().handle(*args, **opts)
        finally:
            if not opts["dir"]:
                shutil.rmtree(work, ignore_errors=True)

    # ---- data --------------------------------------------------------------------------

    def write_blocks(
        self, work: Path, tsdb: Path, num_workers: int, hours: float, interval: float, lead: float, seed: int
    ) -> tuple[int, float]:
        """Every series of every worker as OpenMetrics, one file per 2-h block
        (promtool's block length: it rereads its whole input for each block,
        so one file per block keeps that one pass), each turned into a block."""
        rng = np.random.default_rng(seed)
        layout = bench_metrics._example_layout()
        num_samples = int((hours * 3600 + lead) / interval)
        end = time.time() + lead
        times = end - interval * np.arange(num_samples)[::-1]
        stamps = [f"{t:.3f}" for t in times]
        workers = []
        for w in range(num_workers):
            cohort = "canary" if w % 5 == 0 else "stable"
            raw, _peak = self._series(rng, layout, num_samples, interval, slow=(cohort == "canary"))
            labels = (
                f'job="{deploy.WORKERS_JOB}",instance="bench-{w}.invalid:8000",'
                f'worker="{bench_metrics.PREFIX}w{w:02d}",pool="{bench_metrics.PREFIX}{cohort}",'
                f'cohort="{cohort}",model_name="bench"'
            )
            workers.append((labels, raw))
        families: dict[str, list[tuple[int, str]]] = {}
        for i, key in enumerate(layout.keys):
            name, extra = _split(key)
            families.setdefault(name, []).append((i, extra))
        block = (times // 7200).astype(np.int64)
        num_lines, promtool_seconds = 0, 0.0
        for which in np.unique(block).tolist():
            span = np.flatnonzero(block == which)
            lo, hi = int(span[0]), int(span[-1]) + 1
            path = work / f"block-{which}.om"
            with path.open("w") as out:
                for name, members in families.items():
                    for labels, raw in workers:
                        for i, extra in members:
                            prefix = f"{name}{{{labels}{',' + extra if extra else ''}}} "
                            out.write(
                                "".join(
                                    f"{prefix}{v!r} {t}\n"
                                    for v, t in zip(raw[lo:hi, i].tolist(), stamps[lo:hi], strict=True)
                                )
                            )
                            num_lines += hi - lo
                out.write("# EOF\n")
            started = time.perf_counter()
            made = subprocess.run(
                [PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", "-q", str(path), str(tsdb)],
                capture_output=True,
                text=True,
            )
            promtool_seconds += time.perf_counter() - started
            path.unlink()
            if made.returncode != 0:
                raise CommandError(f"promtool: {made.stderr[-2000:]}")
        return num_lines, promtool_seconds

    def _prometheus_run(self, work: Path, opts: dict[str, Any]) -> None:
        started = time.perf_counter()
        tsdb = work / "tsdb"
        if opts["reuse"] and opts["dir"] and tsdb.is_dir():
            blocks = sum(f.stat().st_size for f in tsdb.rglob("*") if f.is_file())
            self.stdout.write(f"reusing {blocks / 2**20:.0f} MiB of blocks in {tsdb}")
        else:
            lines, promtool_seconds = self.write_blocks(
                work, tsdb, opts["workers"], opts["hours"], opts["interval"], opts["lead_minutes"] * 60, opts["seed"]
            )
            blocks = sum(f.stat().st_size for f in tsdb.rglob("*") if f.is_file())
            self.stdout.write(
                f"{lines} samples of {opts['workers']} workers x {opts['hours']:g} h every "
                f"{opts['interval']:g} s: {blocks / 2**20:.0f} MiB of blocks in "
                f"{time.perf_counter() - started:.0f} s ({promtool_seconds:.0f} s in promtool)"
            )
        config = work / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tsdb}",
                "--storage.tsdb.retention.time=30d",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(work / "prometheus.log").open("w"),
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise CommandError(f"Prometheus did not start: {(work / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.5)
            count = httpx.get(
                f"{url}/api/v1/query", params={"query": "count(up or vllm:request_success_total)"}, timeout=60
            ).json()["data"]["result"]
            self.stdout.write(
                f"Prometheus ready on the blocks: {count[0]['value'][1] if count else 0} request-counter series now"
            )
            self._prometheus_pid, self.store = proc.pid, "Prometheus"
            load = os.getloadavg()
            self.stdout.write(
                f"load average {load[0]:.1f} on {os.cpu_count()} CPUs (timings are wall-clock); "
                f"now {timezone.now():%H:%M:%S}"
            )
            with override_settings(METRICS_BACKEND="prometheus", PROMETHEUS_URL=url, PROMETHEUS_TIMEOUT_SECONDS=30.0):
                self.stdout.write("-- the Prometheus backend --")
                values = query.query_many(figures.PANEL_FIGURES, 300, "cohort")
                self.stdout.write(
                    "the panel's figures now (5 m, per cohort): "
                    + "; ".join(
                        f"{name} " + ", ".join(f"{g} {v:.3g}" if v is not None else f"{g} -" for g, v in by.items())
                        for name, by in values.items()
                    )
                )
                self.time_panel(opts["repeat"])
        finally:
            self._prometheus_pid, self.store = None, "database"
            proc.terminate()
            proc.wait(30)

    _prometheus_pid: int | None = None

    def _cpu_seconds_with_prometheus(self, pid: int | None) -> float:
        total = self._cpu_seconds(pid)
        if self._prometheus_pid is not None:
            fields = open(f"/proc/{self._prometheus_pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def _timed(self, call: Any) -> tuple[Any, float, float]:
        """Wall-clock, and CPU of this process, the database backend and Prometheus."""
        pid = self._db_pid()
        started, cpu_started = time.perf_counter(), self._cpu_seconds_with_prometheus(pid)
        result = call()
        return result, time.perf_counter() - started, self._cpu_seconds_with_prometheus(pid) - cpu_started
