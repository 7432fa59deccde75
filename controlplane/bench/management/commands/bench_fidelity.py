"""``python manage.py bench_fidelity``: do the dashboards show what a client measures?

A benchmark, not a test: it prints figures and ratios, it asserts nothing.
The reference is an independent client, guidellm from PyPI, in a virtual
environment of its own (``--venv``, made on first use with ``python3.11 -m
venv`` and pip; nothing else is downloaded: its tokenizer is the served
model's directory and its prompts are synthetic, ``HF_HUB_OFFLINE=1``).

It starts a small control plane of its own: one reference worker (the tiny
model, CPU, the chunked baseline profile), the gateway in front of it, and
the scraper (``metrics.scrape``'s own round, every ``SCRAPE_INTERVAL``, from
a thread of this command instead of Celery beat), with throwaway rows named
``bench-fid-<id>`` (deleted afterwards). Then, for each run (a rate, a
prompt length, an output length), guidellm streams through the gateway at a
constant rate for ``--duration`` seconds, and the command prints, over
guidellm's own measured window:

* **client**: guidellm's report (its JSON; TPOT here is guidellm's
  "inter-token latency", decode time per token after the first, which is
  Chunkpilot's TPOT; its "TPOT" counts the first token too);
* **dashboard**: the figure registry's scraped figures for the window
  (``ttft_p50``, ``tpot_p99``, ``itl_p99``, ``stall_p99``,
  ``requests_per_second``, ...), read through ``controlplane.metrics.query``
  exactly as the pages read them, so the benchmark measures whatever the
  registry reads;
* **log**: the registry's exact figures from the gateway's request log
  (``client_ttft_p50``, ...);

with the ratios, and each dashboard figure flagged against issue 29's goals:
within 10% of the client at P50, within 15% at P99 (only where the P99 rests
on at least 200 requests), requests/s within 3%. guidellm records no
per-token times, so ITL per gap and the stall have no client figure: the
stall is judged against the log's exact figure, ITL is shown unjudged.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from controlplane.bench.management.commands.bench_gateway import BenchRows
from controlplane.gateway.models import ClientKey, RequestLog, RoutingTable
from controlplane.launcher import child, free_port, gateway_argv, wait_http, wait_until, worker_argv
from controlplane.metrics import conf, figures, query
from controlplane.metrics.scrape import jobs_for_fleet, scrape_fleet

GUIDELLM_VERSION = "0.8.1"
DEFAULT_MODEL = Path("workers/engines/reference/tiny_model")
PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 512,
    "long_prefill_token_threshold": 256,
    "max_num_seqs": 32,
}
# (rate req/s, prompt tokens, output tokens) per run.
DEFAULT_RUNS = "2:256:64,4:256:64,2:1024:64"
QUICK_RUNS = "3:128:32,1.5:1024:64"  # the first has >= 200 requests, so its P99 is judged
QUICK_SECONDS = 75.0
# What each side's percentiles rest on (figures the registry may not have: shown as —).
DASHBOARD_COUNTS = ("ttft_samples", "tpot_samples", "itl_samples", "stall_samples")
LOG_COUNTS = ("request_count", "cancelled_requests")
# issue 29's goals: dashboard against client
P50_BOUND, P99_BOUND, RATE_BOUND = 0.10, 0.15, 0.03
MIN_P99_REQUESTS = 200

Kind = Literal["p50", "p99", "rate"]


@dataclass(frozen=True)
class Row:
    label: str
    kind: Kind
    client: str | None  # key of ClientFigures.values; None: guidellm measures no such thing
    dashboard: str  # a scraped figure of the registry
    log: str | None  # an exact figure of the registry, from the gateway's request log
    judged: bool = True  # False: shown beside, not a figure the goals are about


ROWS: tuple[Row, ...] = (
    Row("TTFT P50", "p50", "ttft_p50", "ttft_p50", "client_ttft_p50"),
    Row("TTFT P99", "p99", "ttft_p99", "ttft_p99", "client_ttft_p99"),
    Row("TPOT P50", "p50", "tpot_p50", "tpot_p50", "client_tpot_p50"),
    Row("TPOT P99", "p99", "tpot_p99", "tpot_p99", "client_tpot_p99"),
    Row("ITL P50", "p50", None, "itl_p50", None),
    Row("ITL P99", "p99", None, "itl_p99", None),
    Row("stall P50", "p50", None, "stall_p50", "client_stall_p50"),
    Row("stall P99", "p99", None, "stall_p99", "client_stall_p99"),
    # The engine's own production gaps (delivery delay left out), where the registry has them.
    Row("engine stall P99", "p99", None, "engine_stall_p99", "client_stall_p99", judged=False),
    Row("requests/s", "rate", "requests_per_second", "requests_per_second", "client_requests_per_second"),
)


@dataclass(frozen=True)
class RunSpec:
    rate: float
    prompt_tokens: int
    output_tokens: int

    @property
    def label(self) -> str:
        return f"{self.rate:g} req/s, {self.prompt_tokens}-token prompts, {self.output_tokens} out"


def parse_runs(text: str) -> list[RunSpec]:
    """``"2:256:64,4:1024:128"`` → runs (rate, prompt tokens, output tokens)."""
    runs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            rate, prompt, output = part.split(":")
            run = RunSpec(float(rate), int(prompt), int(output))
        except ValueError:
            raise CommandError(f"--runs: {part!r} is not RATE:PROMPT_TOKENS:OUTPUT_TOKENS") from None
        if run.rate <= 0 or run.prompt_tokens < 1 or run.output_tokens < 2:
            raise CommandError(f"--runs: {part!r}: rate > 0, prompt >= 1 and output >= 2 tokens")
        runs.append(run)
    if not runs:
        raise CommandError("--runs: at least one run")
    return runs


# ---- guidellm's report ----------------------------------------------------------------


@dataclass(frozen=True)
class ClientFigures:
    """One guidellm benchmark, in seconds and requests per second."""

    start: float  # epoch seconds: its measured window
    end: float
    num_successful: int
    num_errored: int
    num_incomplete: int  # cancelled at its cut-off
    values: dict[str, float | None]

    @property
    def duration_seconds(self) -> float:
        return self.end - self.start


def _percentile_seconds(metrics: dict[str, Any], name: str, pct: str) -> float | None:
    successful = (metrics.get(name) or {}).get("successful") or {}
    if not successful.get("count"):
        return None
    value = (successful.get("percentiles") or {}).get(pct)
    return None if value is None else float(value) / 1000


def parse_report(report: dict[str, Any]) -> list[ClientFigures]:
    """Every benchmark of a guidellm (0.8) JSON report. guidellm's
    ``inter_token_latency_ms`` is (last token - first token) / (tokens - 1)
    per request: Chunkpilot's TPOT; its requests/s is successful requests
    over the measured duration."""
    out = []
    for bench in report.get("benchmarks", []):
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        rps = ((metrics.get("requests_per_second") or {}).get("successful") or {}).get("mean")
        out.append(
            ClientFigures(
                start=float(bench["start_time"]),
                end=float(bench["end_time"]),
                num_successful=int(totals["successful"]),
                num_errored=int(totals["errored"]),
                num_incomplete=int(totals["incomplete"]),
                values={
                    "ttft_p50": _percentile_seconds(metrics, "time_to_first_token_ms", "p50"),
                    "ttft_p99": _percentile_seconds(metrics, "time_to_first_token_ms", "p99"),
                    "tpot_p50": _percentile_seconds(metrics, "inter_token_latency_ms", "p50"),
                    "tpot_p99": _percentile_seconds(metrics, "inter_token_latency_ms", "p99"),
                    "requests_per_second": None if rps is None else float(rps),
                },
            )
        )
    return out


# ---- the comparison --------------------------------------------------------------------


@dataclass(frozen=True)
class Compared:
    row: Row
    client: float | None
    dashboard: float | None
    log: float | None
    reference: Literal["client", "log", ""]  # what the dashboard is judged against
    ratio: float | None  # dashboard / reference
    log_ratio: float | None  # log / client
    verdict: str  # "met", "NOT met", or why it is not judged


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b


def bound_of(kind: Kind) -> float:
    return {"p50": P50_BOUND, "p99": P99_BOUND, "rate": RATE_BOUND}[kind]


def compare(client: ClientFigures, dashboard: dict[str, float | None], log: dict[str, float | None]) -> list[Compared]:
    """Each row of ROWS: the three figures, the ratios, and the verdict
    against the goal (the client where it measures the figure, else the log)."""
    out = []
    for row in ROWS:
        c = client.values.get(row.client) if row.client else None
        d = dashboard.get(row.dashboard)
        lg = log.get(row.log) if row.log else None
        reference: Literal["client", "log", ""] = "client" if c is not None else ("log" if lg is not None else "")
        r = ratio(d, c if reference == "client" else lg)
        if not row.judged:
            verdict = "engine-side, not judged"
        elif not reference:
            verdict = "no reference"
        elif r is None:
            verdict = "no data"
        elif row.kind == "p99" and client.num_successful < MIN_P99_REQUESTS:
            verdict = f"not judged (n={client.num_successful} < {MIN_P99_REQUESTS})"
        else:
            verdict = "met" if abs(r - 1) <= bound_of(row.kind) else "NOT met"
        out.append(Compared(row, c, d, lg, reference, r, ratio(lg, c), verdict))
    return out


def counts_text(counts: dict[str, float | None]) -> str:
    """``ttft_samples 224, ..., request_count 224`` (— for a figure without data or not in the registry)."""
    return ", ".join(f"{name} {'—' if v is None or not math.isfinite(v) else f'{v:.0f}'}" for name, v in counts.items())


def _value(row: Row, value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.3f}" if row.kind == "rate" else f"{value * 1000:.2f}"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def table_lines(compared: Sequence[Compared]) -> list[str]:
    """The run's table as the console shows it (ms for latencies)."""
    lines = [
        f"{'figure (ms, req/s)':20}{'client':>10}{'dashboard':>11}{'log':>10}{'dash/ref':>10}{'log/client':>11}  goal"
    ]
    for c in compared:
        bound = f"±{bound_of(c.row.kind) * 100:.0f}% vs {c.reference}" if c.reference else ""
        lines.append(
            f"{c.row.label:20}{_value(c.row, c.client):>10}{_value(c.row, c.dashboard):>11}"
            f"{_value(c.row, c.log):>10}{_times(c.ratio):>10}{_times(c.log_ratio):>11}  {c.verdict}"
            + (f" ({bound})" if bound and c.verdict in ("met", "NOT met") else "")
        )
    return lines


def markdown_lines(title: str, compared: Sequence[Compared]) -> list[str]:
    lines = [
        f"**{title}**",
        "",
        "| figure | client | dashboard | log | dashboard/ref | log/client | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in compared:
        unit = " (req/s)" if c.row.kind == "rate" else " (ms)"
        ref = f" vs {c.reference}" if c.reference and c.verdict in ("met", "NOT met") else ""
        lines.append(
            f"| {c.row.label}{unit} | {_value(c.row, c.client)} | {_value(c.row, c.dashboard)} | "
            f"{_value(c.row, c.log)} | {_times(c.ratio)} | {_times(c.log_ratio)} | {c.verdict}{ref} |"
        )
    return lines


# ---- the command -----------------------------------------------------------------------


class Command(BaseCommand):
    help = "Dashboard figures against an independent client (guidellm) and the request log."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory")
        parser.add_argument(
            "--runs", default=DEFAULT_RUNS, help=f"RATE:PROMPT:OUTPUT, comma-separated (default {DEFAULT_RUNS})"
        )
        parser.add_argument("--duration", type=float, default=90.0, help="measured seconds per run (default 90)")
        parser.add_argument(
            "--quick",
            action="store_true",
            help=f"runs {QUICK_RUNS}, {QUICK_SECONDS:g} s each (for a machine of 2 cores)",
        )
        parser.add_argument("--max-model-len", type=int, default=4096)
        parser.add_argument("--venv", type=Path, default=Path("var/guidellm-venv"), help="guidellm's own venv")
        parser.add_argument("--guidellm", default=GUIDELLM_VERSION, help="guidellm version to install")
        parser.add_argument(
            "--reports", type=Path, default=Path("var/bench-fidelity"), help="where guidellm's reports are kept"
        )
        parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads (0: its default)")

    def handle(self, *args: Any, **options: Any) -> None:
        runs = parse_runs(QUICK_RUNS if options["quick"] else options["runs"])
        duration = QUICK_SECONDS if options["quick"] else options["duration"]
        model_dir = options["model"].resolve()
        if not (model_dir / "tokenizer.json").exists():
            raise CommandError(f"{model_dir}: no tokenizer.json (guidellm counts tokens with the model's tokenizer)")
        guidellm = self._guidellm(options["venv"], options["guidellm"])
        tag = f"bench-fid-{uuid.uuid4().hex[:6]}"
        reports = options["reports"]
        reports.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.stdout.write(
            f"bench_fidelity {stamp}: guidellm {options['guidellm']} against a reference worker ({model_dir.name}, "
            f"cpu, {PROFILE}) through the gateway; {len(runs)} run(s) x {duration:g} s; {os.cpu_count()} CPUs"
        )
        markdown: list[str] = []
        with tempfile.TemporaryDirectory(prefix=tag) as tmp, self._stack(Path(tmp), tag, model_dir, options) as s:
            for i, run in enumerate(runs, 1):
                out = reports / f"{stamp}-run{i}.json"
                client = self._run_guidellm(guidellm, s, model_dir, run, duration, out, Path(tmp) / f"guidellm-{i}.log")
                self._settle(s, client)
                end = datetime.fromtimestamp(client.end, UTC)
                dashboard = _query(s.pool, [r.dashboard for r in ROWS], client.duration_seconds, end)
                log = _query(s.pool, [r.log for r in ROWS if r.log], client.duration_seconds, end)
                compared = compare(client, dashboard, log)
                title = (
                    f"run {i}: {run.label}, {client.duration_seconds:.0f} s: {client.num_successful} requests "
                    f"({client.num_errored} errored, {client.num_incomplete} cancelled at the client's cut-off); "
                    f"report {out}"
                )
                counts = _query(s.pool, DASHBOARD_COUNTS, client.duration_seconds, end)
                counts.update(_query(s.pool, LOG_COUNTS, client.duration_seconds, end))
                title += "; samples: " + counts_text(counts)
                self.stdout.write(title)
                for line in table_lines(compared):
                    self.stdout.write("  " + line)
                markdown += [*markdown_lines(title, compared), ""]
        self.stdout.write("\n".join(["", "markdown:", "", *markdown]))

    # ---- guidellm ------------------------------------------------------------------------

    def _guidellm(self, venv: Path, version: str) -> Path:
        """guidellm's executable in ``venv``, installing it there first if needed."""
        exe = venv / "bin" / "guidellm"
        if exe.exists():
            return exe
        python = shutil.which("python3.11") or sys.executable
        self.stdout.write(f"installing guidellm=={version} into {venv} (once)")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        wanted = [f"guidellm=={version}"]
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            # The torch build this project runs on (a CPU wheel where it has one),
            # so pip does not fetch a second, much larger build for guidellm.
            wanted.append(f"torch=={importlib.metadata.version('torch')}")
        done = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", *wanted], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not exe.exists():
            raise CommandError(f"pip install {' '.join(wanted)} failed:\n{done.stderr[-3000:]}")
        return exe

    def _run_guidellm(
        self, exe: Path, s: _Stack, model_dir: Path, run: RunSpec, duration: float, out: Path, log: Path
    ) -> ClientFigures:
        backend = (
            f"kind=openai_http,target={s.gateway_url},model={model_dir.name},request_format=/v1/completions,"
            f"http2=false,api_key={s.key}"
        )
        argv = [
            str(exe),
            "run",
            "--backend",
            backend,
            "--profile",
            f"kind=constant,rate={run.rate:g}",
            "--constraint",
            f"kind=max_duration,seconds={duration:g}",
            "--tokenizer",
            f"kind=huggingface_auto,model={model_dir}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={run.prompt_tokens},output_tokens={run.output_tokens}",
            "--output",
            f"kind=json,path={out.resolve()}",
            "--disable-console-interactive",
        ]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # guidellm starts 10 client processes by default; on a small machine
            # they would take the CPU the engine is measured on.
            "GUIDELLM__MAX_WORKER_PROCESSES": "2",
        }
        with open(log, "wb") as output:
            done = subprocess.run(argv, stdout=output, stderr=subprocess.STDOUT, env=env, check=False)
        if done.returncode != 0 or not out.exists():
            raise CommandError(f"guidellm exited with {done.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        benchmarks = parse_report(json.loads(out.read_text()))
        if len(benchmarks) != 1:
            raise CommandError(f"{out}: {len(benchmarks)} benchmarks, expected one")
        return benchmarks[0]

    # ---- the stack -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _stack(self, tmp: Path, tag: str, model_dir: Path, options: dict[str, Any]) -> Iterator[_Stack]:
        model = model_dir.name
        if RoutingTable.objects.filter(model=model).exists():
            raise CommandError(f"a routing table for {model!r} exists already in this database; use another one")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        worker_env = {**env, **({"OMP_NUM_THREADS": str(options["threads"])} if options["threads"] > 0 else {})}
        port, gateway_port = free_port(), free_port()
        worker_url, gateway_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gateway_port}"
        rows = BenchRows.make(tag, model, worker_url, canary_worker=False)
        try:
            with contextlib.ExitStack() as stack:
                argv = worker_argv(
                    model_dir,
                    port,
                    max_model_len=options["max_model_len"],
                    device="cpu",
                    log_level="warning",
                    profile=PROFILE,
                )
                worker = stack.enter_context(child(argv, tmp / "worker.log", worker_env))
                wait_http(f"{worker_url}/v1/models", worker, tmp / "worker.log", timeout=240)
                gateway = stack.enter_context(
                    child(gateway_argv(gateway_port, log_level="warning"), tmp / "gw.log", env)
                )
                wait_http(f"{gateway_url}/health", gateway, tmp / "gw.log")
                wait_until(
                    lambda: model in httpx.get(f"{gateway_url}/health", timeout=2).json().get("models", {}),
                    30,
                    "the gateway to load the benchmark's routing table",
                    interval=0.2,
                )
                s = _Stack(gateway_url, rows.key, rows.pools[0].name, rows.key_row)
                _warm_up(gateway_url, rows.key, model)
                scraper = stack.enter_context(_Scraper(rows.workers[0].pk))
                s.scraper = scraper
                yield s
        finally:
            rows.delete()

    def _settle(self, s: _Stack, client: ClientFigures) -> None:
        """Until a scrape after the client's window is stored and the
        gateway's log rows of the window have landed (its writer batches)."""
        assert s.scraper is not None
        wait_until(
            lambda: s.scraper is not None and s.scraper.last_round > client.end,
            60,
            "a scrape after the run",
            detail=lambda: f"scraper: {s.scraper.error!r}" if s.scraper is not None else "",
        )
        last = [-1, time.monotonic()]

        def settled() -> bool:
            n = RequestLog.objects.filter(api_key=s.key_row).count()
            if n != last[0]:
                last[:] = [n, time.monotonic()]
            return n >= client.num_successful and time.monotonic() - last[1] > 2.0

        wait_until(settled, 60, "the gateway's log rows", interval=0.5)


def _query(pool: str, names: Sequence[str], window_seconds: float, now: datetime) -> dict[str, float | None]:
    """The registry's figures over the window ending ``now`` for ``pool``;
    a name the registry does not have (yet) reads as no data."""
    known = [n for n in names if n in figures.FIGURES]
    result = query.query_many(known, window_seconds, selector={"pool": pool}, now=now)
    return {name: result.get(name, {}).get(query.FLEET) for name in names}


def _warm_up(gateway_url: str, key: str, model: str) -> None:
    """A few requests before the first window, so it does not time a cold engine."""
    body = {"model": model, "prompt": "warm up " * 64, "max_tokens": 16, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            http.post(f"{gateway_url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})


@dataclass
class _Stack:
    gateway_url: str
    key: str
    pool: str
    key_row: ClientKey
    scraper: _Scraper | None = None


class _Scraper(threading.Thread):
    """The scraper's own round for the benchmark's worker, every
    SCRAPE_INTERVAL, as Celery beat runs it on a fleet."""

    def __init__(self, worker_id: int):
        super().__init__(name="bench-fidelity-scraper", daemon=True)
        self.worker_id = worker_id
        self.stopping = threading.Event()
        self.last_round = 0.0  # epoch seconds of the newest stored round
        self.error: BaseException | None = None

    def __enter__(self) -> _Scraper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join(30)

    def run(self) -> None:
        interval = conf.SCRAPE_INTERVAL.get()
        try:
            while not self.stopping.is_set():
                started = time.time()
                jobs = [j for j in jobs_for_fleet() if j.worker_id == self.worker_id]
                scrape_fleet(jobs=jobs)
                self.last_round = started
                self.stopping.wait(max(0.0, interval - (time.time() - started)))
        except BaseException as exc:  # shown by _settle's wait, which then times out
            self.error = exc
            raise
        finally:
            connection.close()
