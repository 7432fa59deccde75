"""The A/B validation harness: each scenario of the panel runs twice on
the same workers, once on its baseline profile (monolithic, or chunked
with a budget that never splits) and once on the tuned chunked profile,
with the same seeded requests and a cold prefix cache each time. What the
clients saw decides whether chunking paid (``outcome.chunking_pays``); the
advisor's verdict on the run the pool is observed in (its live figures
only: the worker's ``/metrics`` scraped by the real scraper, and the
request log) is compared with it.

Design note. The harness is engine-agnostic: it takes a ``WorkerSet``,
something that serves a profile on some workers and gives their URLs.
``LaunchedWorkers`` starts ``python -m workers serve`` processes (the
reference engine on the tiny model by default, or any engine and model the
command runs) for each run and stops them after; ``RunningWorkers`` takes
workers someone else started, one set of URLs per profile. Either way the
prefix cache is reset before a run (``POST /reset_prefix_cache``; a worker
just started has an empty one).

Phases of one scenario:
1. plan its requests once (seeded), from the workers' own context length;
2. for each profile (baseline first, then chunked): serve it, warm the
   workers up, reset their prefix cache, replay the plan; when this is the
   observed profile, scrape the workers every ``scrape_interval_seconds``
   meanwhile and write one request-log row per request, as the gateway
   would;
3. judge: the outcome rule on the two runs, the advisor on the observed
   run's window (``controlplane.advisor.models.compute``, its public entry
   point), and whether the two agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import httpx
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from controlplane.advisor.models import compute
from controlplane.advisor.validation.outcome import Judgement, Objectives, Outcome, chunking_pays, outcome_of
from controlplane.advisor.validation.scenarios import CHUNKED, Scenario, profiles
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog
from controlplane.launcher import child, free_port, worker_argv
from controlplane.metrics.scrape import Job, scrape_fleet
from controlplane.profiles.models import Profile
from workers import replay
from workers.loadgen import Client, PlannedRequest, RequestRecord
from workers.loadgen import replay as replay_planned

TINY_MODEL = Path(__file__).resolve().parents[3] / "workers" / "engines" / "reference" / "tiny_model"
WORTH_IT = "worth_it"
# The verdicts that say switching will not pay: no long-prefill stall past the
# objective ("not worth it"), or stalls with another cause than long prefills.
NOT_WORTH_IT = ("not_worth_it", "other_cause")


def agrees(advisor: str, pays: bool) -> bool:
    """Whether the advisor's overall verdict says what the A/B outcome did;
    "not enough data" (or no report) agrees with nothing."""
    return advisor == WORTH_IT if pays else advisor in NOT_WORTH_IT


# ---- worker sets ------------------------------------------------------------------------------


class WorkerSet(Protocol):
    # True: every run gets freshly started workers, whose prefix cache is empty
    # but for the warm-up's prompts, so a worker without the reset is acceptable
    fresh_per_run: bool

    def serve(self, name: str, profile: Mapping[str, Any]) -> contextlib.AbstractContextManager[list[str]]:
        """Workers running ``profile`` (called ``name`` in the panel): their base URLs."""
        ...


@dataclass
class LaunchedWorkers:
    """``python -m workers serve`` processes started for each run (a
    profile is fixed for a worker's life), on the model in ``model``."""

    model: Path
    log_dir: Path
    max_model_len: int
    num_workers: int = 1
    engine: str | None = None
    device: str | None = "cpu"
    threads: int = 1  # torch threads per worker (OMP_NUM_THREADS); 0: their default
    ready_timeout_seconds: float = 240.0
    nice: int = 0  # the workers' niceness: below 0, a shared host's other work waits first
    fresh_per_run: bool = True

    @contextlib.contextmanager
    def serve(self, name: str, profile: Mapping[str, Any]) -> Iterator[list[str]]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.threads > 0:
            env["OMP_NUM_THREADS"] = str(self.threads)
        with contextlib.ExitStack() as stack:
            started: list[tuple[str, Any, Path]] = []
            for i in range(self.num_workers):
                port = free_port()
                log = self.log_dir / f"{name}-{i}.log"
                argv = worker_argv(
                    self.model,
                    port,
                    max_model_len=self.max_model_len,
                    engine=self.engine,
                    device=self.device,
                    log_level="warning",
                    profile=dict(profile),
                )
                if self.nice:
                    argv = ["nice", "-n", str(self.nice), *argv]
                proc = stack.enter_context(child(argv, log, env))
                started.append((f"http://127.0.0.1:{port}", proc, log))
            for url, proc, log in started:
                _wait_ready(url, proc, log, self.ready_timeout_seconds)
            yield [url for url, _, _ in started]


@dataclass
class RunningWorkers:
    """Workers started elsewhere (GPU hosts, simulated workers): the URLs
    that serve each profile of the panel, by name (``monolithic``,
    ``chunked-unsplit``, ``chunked``)."""

    urls: Mapping[str, Sequence[str]]
    fresh_per_run: bool = False

    @contextlib.contextmanager
    def serve(self, name: str, profile: Mapping[str, Any]) -> Iterator[list[str]]:
        if not self.urls.get(name):
            raise ValueError(f"no workers given for the {name!r} profile")
        yield list(self.urls[name])


def _wait_ready(url: str, proc: Any, log: Path, timeout_seconds: float) -> None:
    """Until the worker names its context length (its engine is loaded)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {url} exited ({proc.returncode}): {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
            card = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]
            if card.get("max_model_len"):
                return
        time.sleep(0.5)
    raise RuntimeError(f"worker {url} not ready after {timeout_seconds:.0f} s: {log.read_text()[-2000:]}")


def reset_prefix_cache(urls: Sequence[str], *, required: bool = True) -> None:
    """Empty every worker's prefix cache, so a run starts cold as the one
    before it did. A worker without the operation is an error when
    ``required`` (one that ran earlier runs), else skipped (one just started)."""
    for url in urls:
        reply = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
        if reply.status_code in (404, 405) and not required:
            continue
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: POST /reset_prefix_cache answered {reply.status_code}: {reply.text[:300]}")


def _card(url: str) -> tuple[str, int]:
    card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    return str(card["id"]), int(card["max_model_len"])


# ---- driving the requests ----------------------------------------------------------------------


async def _drive_all(
    url_sets: Sequence[Sequence[str]], planned: Sequence[PlannedRequest]
) -> list[tuple[list[RequestRecord], float]]:
    """The same plan on each worker set at once."""
    return list(await asyncio.gather(*(_drive(urls, planned) for urls in url_sets)))


async def _drive(urls: Sequence[str], planned: Sequence[PlannedRequest]) -> tuple[list[RequestRecord], float]:
    """Every planned request at its time, round-robin over the workers (open loop)."""
    clients = [Client(url, model=None, api_key=None) for url in urls]
    try:
        for c in clients:
            c.model, _ = await c.discover()
        shares = [list(planned[i :: len(clients)]) for i in range(len(clients))]
        started = time.perf_counter()
        done = await asyncio.gather(*(replay_planned(c, share) for c, share in zip(clients, shares, strict=True)))
        wall = time.perf_counter() - started
    finally:
        for c in clients:
            await c.close()
    # In plan order: request k went to worker k % len(urls).
    ordered: list[RequestRecord] = [None] * len(planned)  # type: ignore[list-item]
    for i, (records, _) in enumerate(done):
        ordered[i :: len(clients)] = records
    return ordered, wall


def _warm_up(urls: Sequence[str], max_model_len: int, vocabulary: list[int]) -> None:
    """A long prompt among short ones on each worker: first-call costs
    (allocations, kernel choices) are paid before the measured run."""
    long_ids = [vocabulary[i % len(vocabulary)] for i in range(max_model_len * 3 // 4)]
    warm = [PlannedRequest(0.0, "completions", 16, prompt_token_ids=vocabulary[:32]) for _ in range(3)]
    warm.append(PlannedRequest(0.05, "completions", 4, prompt_token_ids=long_ids))
    for url in urls:
        records, _ = asyncio.run(_drive([url], warm))
        failed = [r.error or r.status for r in records if not r.success]
        if failed:
            raise RuntimeError(f"{url}: warm-up requests failed: {failed[:3]}")


# ---- the control plane's view of the observed run ---------------------------------------------


class Observation:
    """The observed run as the control plane sees it live: a pool on the
    run's profile, one worker row per URL, the real scraper's snapshots and
    one request-log row per request. Its rows are named ``tag`` and deleted
    by ``delete``."""

    def __init__(self, tag: str, profile_fields: Mapping[str, Any], urls: Sequence[str], max_model_len: int):
        self.tag = tag
        self.profile = Profile.objects.create(name=tag, engine_kind="reference")
        revision = self.profile.add_revision(dict(profile_fields), comment="validation run")
        self.pool = Pool.objects.create(name=tag)
        self.pool.set_desired_revision(revision)
        self.workers = [
            Worker.objects.create(
                name=f"{tag}-{i}",
                url=url,
                pool=self.pool,
                state=WorkerState.READY,
                engine_kind="reference",
                model=_card(url)[0],
                max_model_len=max_model_len,
                running_revision=revision,
                running_profile=dict(profile_fields),
                hardware={"device": "cpu"},
            )
            for i, url in enumerate(urls)
        ]
        self.jobs = [Job(w.pk, w.name, w.url, self.pool.name, "stable") for w in self.workers]
        self.by_url = {w.url: w for w in self.workers}

    def scrape(self) -> None:
        scrape_fleet(jobs=self.jobs)

    @contextlib.contextmanager
    def scraping(self, interval_seconds: float) -> Iterator[None]:
        """The real scraper on its own thread (and database connection) every ``interval_seconds``."""
        stop = threading.Event()

        def loop() -> None:
            try:
                while not stop.wait(interval_seconds):
                    self.scrape()
            finally:
                connection.close()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(60)

    def log(self, records: Sequence[RequestRecord], urls: Sequence[str], started_at: datetime) -> None:
        """One request-log row per request (``records`` in plan order, request
        k sent to ``urls[k % len(urls)]``), with what the gateway logs of it."""
        rows = []
        for i, r in enumerate(records):
            worker = self.by_url[urls[i % len(urls)]] if urls else None
            rows.append(
                RequestLog(
                    request_id=uuid.uuid4().hex,
                    created_at=started_at + timedelta(seconds=r.start_seconds),
                    model=worker.model if worker else "",
                    cohort="stable",
                    pool=self.pool,
                    worker=worker,
                    profile_revision=self.pool.desired_revision,
                    prompt_tokens=r.prompt_tokens if r.success else None,
                    cached_tokens=r.cached_tokens if r.success else None,
                    output_tokens=r.output_tokens if r.success else None,
                    ttft_seconds=r.ttft_seconds,
                    max_gap_seconds=r.max_gap_seconds,
                    tpot_seconds=r.tpot_seconds,
                    e2e_seconds=r.latency_seconds,
                    status=r.status or 502,
                    error=r.error or "",
                    stream=True,
                )
            )
        RequestLog.objects.bulk_create(rows)

    def delete(self) -> None:
        RequestLog.objects.filter(pool=self.pool).delete()
        Worker.objects.filter(pk__in=[w.pk for w in self.workers]).delete()  # their targets and snapshots go too
        self.pool.delete()
        self.profile.delete()


# ---- the panel -------------------------------------------------------------------------------


@dataclass
class Row:
    """One scenario's result: both runs, the outcome, the advisor, and whether they agree."""

    scenario: Scenario
    baseline: Outcome
    chunked: Outcome
    judgement: Judgement
    advisor: str  # worth_it, not_worth_it, not_enough_data
    advisor_reasons: list[str]
    report: dict[str, Any] = field(repr=False)

    @property
    def agree(self) -> bool:
        return agrees(self.advisor, self.judgement.pays)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "what": self.scenario.what,
            "baseline_profile": self.scenario.baseline,
            "observed_profile": self.scenario.observed_profile(),
            "baseline": self.baseline.to_json(),
            "chunked": self.chunked.to_json(),
            "chunking_pays": self.judgement.pays,
            "outcome_reason": self.judgement.reason,
            "advisor": self.advisor,
            "advisor_reasons": self.advisor_reasons,
            "agree": self.agree,
            "report": self.report,
        }


@dataclass
class Harness:
    workers: WorkerSet
    objectives: Objectives
    max_model_len: int  # the workers' context: the scenarios' lengths are fractions of it
    model_dir: Path | None = None  # the served checkpoint, for its tokenizer's word ids
    budget: int = 256
    chunk_cap: int = 128
    rate_scale: float = 1.0
    duration_scale: float = 1.0
    scrape_interval_seconds: float = 0.5
    side_by_side: bool = False  # both arms at once, on two worker sets
    advisor_settings: Mapping[str, Any] = field(
        default_factory=dict
    )  # settings the advisor reads, as an operator set them
    say: Callable[[str], None] = print

    def run(self, scenario: Scenario) -> Row:
        vocabulary = replay.vocabulary(self.model_dir)
        planned = scenario.plan(
            max_model_len=self.max_model_len,
            vocabulary=vocabulary,
            rate_scale=self.rate_scale,
            duration_scale=self.duration_scale,
        )
        arms = (scenario.baseline, CHUNKED)
        observed = scenario.observed_profile()
        outcomes: dict[str, Outcome] = {}
        report: dict[str, Any] = {}
        # Side by side: both arms at once on two worker sets, under the same
        # ambient load (a shared host); else one after the other.
        batches = [arms] if self.side_by_side else [(a,) for a in arms]
        for batch in batches:
            with contextlib.ExitStack() as stack:
                urls = {name: self._ready(stack, name, vocabulary) for name in batch}
                obs = None
                if observed in batch:
                    fields = profiles(self.max_model_len, budget=self.budget, chunk_cap=self.chunk_cap)[observed]
                    tag = f"validate-{scenario.name}-{uuid.uuid4().hex[:6]}"
                    obs = Observation(tag, fields, urls[observed], self.max_model_len)
                    stack.callback(obs.delete)
                    obs.scrape()  # the window's first snapshot: the warm-up stays out of it
                scraping = obs.scraping(self.scrape_interval_seconds) if obs else contextlib.nullcontext()
                window_start = started_at = timezone.now()
                with scraping:
                    results = asyncio.run(_drive_all([urls[name] for name in batch], planned))
                for name, (records, wall) in zip(batch, results, strict=True):
                    outcomes[name] = outcome_of(records, wall, self.objectives)
                    self.say(f"  {scenario.name} on {name}: {_line(outcomes[name])}")
                if obs is not None:
                    obs.scrape()
                    obs.log(results[batch.index(observed)][0], urls[observed], started_at)
                    end = timezone.now()
                    report = self._advise(obs, (end - window_start).total_seconds() + 0.5, end)
        judgement = chunking_pays(outcomes[scenario.baseline], outcomes[CHUNKED], self.objectives)
        return Row(
            scenario,
            outcomes[scenario.baseline],
            outcomes[CHUNKED],
            judgement,
            str(report.get("overall", "")),
            list(report.get("overall_reasons", [])),
            report,
        )

    def _ready(self, stack: contextlib.ExitStack, name: str, vocabulary: list[int]) -> list[str]:
        """Workers serving profile ``name``, warmed up, their prefix cache empty."""
        fields = profiles(self.max_model_len, budget=self.budget, chunk_cap=self.chunk_cap)[name]
        return self.ready(stack, name, fields, vocabulary)

    def ready(
        self, stack: contextlib.ExitStack, name: str, fields: Mapping[str, Any], vocabulary: list[int]
    ) -> list[str]:
        """Workers serving ``fields`` (a profile called ``name``), warmed up, their prefix cache empty."""
        urls = stack.enter_context(self.workers.serve(name, fields))
        lengths = {_card(u)[1] for u in urls}
        if lengths != {self.max_model_len}:
            raise ValueError(f"the {name} workers serve a context of {lengths}, not {self.max_model_len}")
        _warm_up(urls, self.max_model_len, vocabulary)
        reset_prefix_cache(urls, required=not self.workers.fresh_per_run)
        return urls

    def _advise(self, obs: Observation, window_seconds: float, end: datetime) -> dict[str, Any]:
        """The advisor's report on the observed pool, with the panel's TBT objective."""
        kwargs: dict[str, Any] = {}
        if "tbt_objective_seconds" in inspect.signature(compute).parameters:
            kwargs["tbt_objective_seconds"] = self.objectives.tbt_seconds
        with override_settings(**self.advisor_settings):
            return compute(obs.pool, window_seconds, end, **kwargs)


def _line(o: Outcome) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1000:.1f}"

    return (
        f"{o.num_ok}/{o.num_requests} ok in {o.wall_seconds:.1f} s, stall P99 {ms(o.stall_p99_seconds)} ms, "
        f"TBT P99 {ms(o.tbt_p99_seconds)} ms, TPOT P99 {ms(o.tpot_p99_seconds)} ms, TTFT P50/P99 "
        f"{ms(o.ttft_p50_seconds)}/{ms(o.ttft_p99_seconds)} ms, {o.output_tokens_per_second:.0f} tok/s, "
        f"goodput {o.goodput:.2f} req/s, prefix hits {o.prefix_hit_share:.0%}"
        + (f"; failed: {' | '.join(o.failure_reasons)}" if o.failure_reasons else "")
    )


# For other checks on the same workers (``experiment``): a plan driven open loop, and a run's one-line summary.
drive = _drive
describe = _line
