"""The experiment runner: drives one experiment from its stored state, one
step per Celery task, the way ``rollouts.reconcile`` drives a rollout.

Design note. ``drive(experiment_id)`` first **claims** the experiment with
a conditional update of its lease (``lease_token``, ``lease_until``); a run
that finds the lease held by a live runner returns at once, so running it
twice is harmless. It then does the **next step** the stored state calls
for, renewing the lease every second while it works, and hands over to a
fresh task for the step after:

1. pending → take the workers out of traffic: remember each one's revision
   override and cordon (``previous``), cordon it, wait until the requests
   it had in flight are done; → running.
2. running → the next (repeat, arm) of the **schedule** not yet measured.
   Repeats are the outer loop and the arm order rotates by one each repeat
   (a Latin square: with as many repeats as arms every arm runs once in
   every position), so drift over the run (a warming host, a neighbour)
   falls on every arm alike instead of on the last ones. One step: point
   the workers at the arm's revision (as a rollout moves a worker), wait
   until they report ready on it, warm up, **reset every worker's prefix
   cache**, then replay repeat ``r``: the same seeded requests for every
   arm (paired repeats at equal offered load), at the workload's recorded
   rate, against the workers (never through the gateway), measured by the
   replay client and by the workers' own ``/metrics`` before and after.
   The cache reset makes each arm build its own prefix hits from the
   workload's sharing instead of inheriting an earlier arm's. A repeat's
   result is stored as soon as it is taken, so a runner lost mid-run
   resumes at the next one and none runs twice. A worker that stops
   answering fails the arm, with the reason; the other arms go on with
   the workers that are left. After an arm's last repeat, with a capacity
   ramp, one replay per rate of the ramp, each point stored as taken
   (``capacity``), up to the first rate at which fewer than 90% of the
   requests meet both objectives; then the arm is finished.
3. restoring (after the last arm, or on abort) → every worker back on its
   previous override and cordon, then the recommendation; → succeeded or
   aborted.

The abort flag is read at every renewal: a replay under way is cancelled
and the workers are restored first. A runner lost with its Celery worker
leaves its lease to expire; beat's ``experiments.sweep`` restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import aiohttp
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from controlplane import audit
from controlplane.audit.models import AuditEvent
from controlplane.experiments import conf, measure
from controlplane.experiments.capacity import RampPoint, ramp_finished, serving_capacity
from controlplane.experiments.models import Arm, ArmStatus, Experiment, Phase
from controlplane.experiments.recommend import ArmFigures, Objectives, Recommendation, recommend
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from controlplane.gateway import conf as gateway_conf
from controlplane.metrics import catalogue
from controlplane.profiles.models import ProfileRevision
from workers import loadgen, replay

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_SECONDS = 0.5
WARMUP_SEED = 1000
RAMP_SEED = 2000
RAMP_MIN_REQUESTS = 10  # a ramp point replays at least this many requests, however short or slow


class LeaseLost(Exception):
    """Another runner holds the experiment now."""


class Aborted(Exception):
    """The abort flag went up while an arm ran."""


class ArmFailed(Exception):
    """The arm cannot be measured; the message says why."""


class Lease:
    def __init__(self, experiment_id: int, token: str):
        self.experiment_id, self.token = experiment_id, token

    def renew(self) -> bool:
        """Extend the lease; True when an abort was requested. Raises LeaseLost."""
        until = timezone.now() + timedelta(seconds=conf.EXPERIMENT_LEASE_SECONDS.get())
        if not Experiment.objects.filter(pk=self.experiment_id, lease_token=self.token).update(lease_until=until):
            raise LeaseLost(self.experiment_id)
        return bool(Experiment.objects.filter(pk=self.experiment_id).values_list("abort_requested", flat=True).first())

    def release(self) -> None:
        Experiment.objects.filter(pk=self.experiment_id, lease_token=self.token).update(
            lease_until=None, lease_token=""
        )


def claim(experiment_id: int) -> Lease | None:
    token = uuid.uuid4().hex
    now = timezone.now()
    until = now + timedelta(seconds=conf.EXPERIMENT_LEASE_SECONDS.get())
    claimed = Experiment.objects.overdue(now).filter(pk=experiment_id).update(lease_token=token, lease_until=until)
    return Lease(experiment_id, token) if claimed else None


# ---- the loop ------------------------------------------------------------------------------


def drive(experiment_id: int) -> bool:
    """Claim, do the next step, release. True when there is more to do
    (the task enqueues its successor)."""
    lease = claim(experiment_id)
    if lease is None:
        return False
    try:
        more = step(experiment_id, lease)
    except LeaseLost:
        log.info("experiment %s: another runner took over", experiment_id)
        return False
    lease.release()
    return more


def step(experiment_id: int, lease: Lease) -> bool:
    exp = Experiment.objects.get(pk=experiment_id)
    phase = Phase(exp.phase)
    if phase == Phase.PENDING:
        if exp.abort_requested:
            finish(exp, Phase.ABORTED)
            return False
        prepare(exp, lease)
        return True
    if phase == Phase.RUNNING:
        arm, repeat = next_step(exp)
        if exp.abort_requested or arm is None:
            to_restoring(exp)
            return True
        run_arm(exp, arm, lease, repeat)
        return True
    if phase == Phase.RESTORING:
        restore(exp, lease)
        finish(exp, Phase.ABORTED if exp.abort_requested else Phase.SUCCEEDED)
    return False


def _wait(lease: Lease, seconds: float, done: Callable[[], bool]) -> bool:
    """Poll ``done`` until it holds (True) or ``seconds`` pass (False),
    renewing the lease; raises Aborted when the flag goes up."""
    deadline = time.monotonic() + seconds
    while True:
        if done():
            return True
        if lease.renew():
            raise Aborted()
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)


# ---- 1. out of traffic ----------------------------------------------------------------------


def prepare(exp: Experiment, lease: Lease) -> None:
    now = timezone.now()
    with transaction.atomic():
        exp = Experiment.objects.select_for_update().get(pk=exp.pk)
        workers = list(exp.workers.select_for_update().order_by("name"))
        if not exp.previous:
            exp.previous = {
                str(w.pk): {
                    "name": w.name,
                    "desired_revision": w.desired_revision_id,
                    "running_revision": w.running_revision_id,
                    "cordoned": w.cordoned,
                }
                for w in workers
            }
            exp.save(update_fields=["previous"])
        for w in workers:
            if not w.cordoned:
                before = w.audit_state()
                w.set_flags(cordoned=True)
                audit.record(exp.actor, "worker.cordon", w, before, w.audit_state(), time=now)
        exp.message = "workers cordoned; waiting for their client requests to finish"
        exp.save(update_fields=["message"])
        exp.changed()
    exp.set_progress(stage="draining", arm=0, num_arms=exp.arms.count(), seconds_left=_seconds_left(exp, None, 0))
    ids = [int(i) for i in exp.previous]
    # A gateway hears of a cordon at once (fleet.worker_changed), and reloads
    # its routing state on its slow poll regardless: after one poll period no
    # gateway can still be routing to these workers.
    routed_until = now + timedelta(seconds=gateway_conf.GATEWAY_POLL_SECONDS.get() + 1.0)

    def idle() -> bool:
        if timezone.now() < routed_until:
            return False
        rows = Worker.objects.filter(pk__in=ids).values_list("state", "load", "last_heartbeat_at")
        return all(
            WorkerState(state).is_lost
            or (
                seen is not None
                and seen > now
                and not (load or {}).get("num_requests_running")
                and not (load or {}).get("num_requests_waiting")
            )
            for state, load, seen in rows
        )

    drained = _wait(lease, conf.EXPERIMENT_DRAIN_TIMEOUT_SECONDS.get(), idle)
    with transaction.atomic():
        exp = Experiment.objects.select_for_update().get(pk=exp.pk)
        exp.phase, exp.started_at = Phase.RUNNING, timezone.now()
        exp.message = "out of traffic" if drained else "out of traffic (requests still in flight after the wait)"
        exp.save(update_fields=["phase", "started_at", "message"])
        exp.record("started", None, {"workers": sorted(p["name"] for p in exp.previous.values()), "drained": drained})
        exp.changed()


# ---- 2. one arm, one repeat ------------------------------------------------------------------


def schedule(num_arms: int, repeats: int) -> list[tuple[int, int]]:
    """(repeat, arm index) in the order they run: repeat by repeat, the arm
    order rotated by one each repeat."""
    return [(r, (r + k) % num_arms) for r in range(repeats) for k in range(num_arms)]


def next_step(exp: Experiment) -> tuple[Arm | None, int | None]:
    """The next arm to run and its repeat; repeat None: the arm has all its
    repeats and is finished next (its ramp, its summary)."""
    arms = {a.index: a for a in exp.arms.filter(status__lt=ArmStatus.SUCCEEDED)}
    if not arms:
        return None, None
    num_arms = max(exp.arms.values_list("index", flat=True)) + 1
    for repeat, index in schedule(num_arms, exp.repeats):
        arm = arms.get(index)
        if arm is not None and not any(r["repeat"] == repeat for r in arm.results):
            return arm, repeat
    return min(arms.values(), key=lambda a: a.index), None


def _seconds_left(exp: Experiment, arm: Arm | None, current_left: float) -> float:
    """``current_left`` plus every repeat (and ramp) not yet run after this one."""
    per_repeat = exp.warmup_seconds + exp.duration_seconds
    ramp = len(exp.capacity_rate_scales or []) * exp.capacity_seconds
    left = 0.0
    for other in exp.arms.filter(status__lt=ArmStatus.SUCCEEDED):
        left += max(0, exp.repeats - len(other.results) - (1 if arm is not None and other.pk == arm.pk else 0)) * (
            per_repeat
        )
        left += ramp
    return round(current_left + left, 1)


def drawn_or_failed(planned: list[Any], exp: Experiment) -> list[Any]:
    """An arm measured on no requests would pass as a success with zeros:
    it fails instead, saying how to get requests into it."""
    if planned:
        return planned
    rate = exp.workload.workload_spec().rate_per_second * exp.rate_scale
    raise ArmFailed(
        f"the replay drew no requests in {exp.duration_seconds:g} s at the workload's {rate:.3g} requests/s "
        "(rate × rate scale): lengthen the arms or raise the rate scale"
    )


def run_arm(exp: Experiment, arm: Arm, lease: Lease, repeat: int | None) -> None:
    """One step of one arm: its repeat ``repeat``, or (None) its ramp and
    its finish once every repeat is in."""
    now = timezone.now()
    # A runner starts an arm once, and again only to resume a repeat that an
    # earlier runner started and lost: each arm's steps interleave with the others'.
    resumed = (
        repeat is not None
        and AuditEvent.objects.filter(
            action="experiment.arm_started", object_id=str(exp.pk), after__arm=arm.name, after__repeat=repeat
        ).exists()
    )
    Arm.objects.filter(pk=arm.pk).update(
        status=ArmStatus.RUNNING,
        attempts=F("attempts") + (1 if arm.status == ArmStatus.PENDING or resumed else 0),
        started_at=arm.started_at or now,
    )
    arm.refresh_from_db()
    num_arms = exp.arms.count()
    what = f"repeat {repeat + 1} of {exp.repeats}" if repeat is not None else "finishing"
    exp.message = f"arm {arm.index + 1} of {num_arms}: {arm.name}, {what}"
    Experiment.objects.filter(pk=exp.pk).update(message=exp.message)
    exp.record(
        "arm_started",
        None,
        {"arm": arm.name, "attempt": arm.attempts, "repeat": repeat, "repeats_done": len(arm.results)},
        now=now,
    )
    try:
        if repeat is not None:
            run_repeat(exp, arm, apply_arm(exp, arm, lease, num_arms), lease, num_arms, repeat)
            return
        if exp.capacity_rate_scales:  # else finishing needs no worker
            run_ramp(exp, arm, apply_arm(exp, arm, lease, num_arms), lease, num_arms)
    except Aborted:
        Arm.objects.filter(pk=arm.pk).update(
            status=ArmStatus.SKIPPED, error="aborted while it ran", finished_at=timezone.now()
        )
        exp.record("arm_skipped", None, {"arm": arm.name, "reason": "aborted"})
        exp.changed()
        return
    except ArmFailed as exc:
        arm.refresh_from_db()
        Arm.objects.filter(pk=arm.pk).update(
            status=ArmStatus.FAILED, error=str(exc), finished_at=timezone.now(), summary=measure.summarize(arm.results)
        )
        exp.record("arm_failed", None, {"arm": arm.name, "reason": str(exc)})
        exp.changed()
        return
    arm.refresh_from_db()
    summary = measure.summarize(arm.results)
    if arm.capacity is not None:
        summary["capacity"] = {"mean": arm.capacity, "half_range": 0.0, "values": [arm.capacity]}
    Arm.objects.filter(pk=arm.pk).update(
        status=ArmStatus.SUCCEEDED, summary=summary, finished_at=timezone.now(), error=""
    )
    exp.record(
        "arm_succeeded",
        None,
        {
            "arm": arm.name,
            "goodput": summary.get("goodput", {}).get("mean"),
            "output_throughput": summary.get("output_throughput", {}).get("mean"),
            "capacity": arm.capacity,
        },
    )
    exp.changed()


def _live_workers(exp: Experiment) -> list[Worker]:
    return [w for w in exp.workers.order_by("name") if not WorkerState(w.state).is_lost]


def apply_arm(exp: Experiment, arm: Arm, lease: Lease, num_arms: int) -> list[Worker]:
    """Point every live worker at the arm's revision, exactly as a rollout
    moves one, and wait until each reports ready on it."""
    workers = _live_workers(exp)
    if not workers:
        raise ArmFailed("no live worker left to run it on")
    revision = arm.revision
    for w in workers:
        if w.desired_revision_id != revision.pk:
            with transaction.atomic():
                before = w.audit_state()
                w.set_desired_revision(revision)
                audit.record(exp.actor, "worker.move", w, before, w.audit_state())
    exp.set_progress(
        stage="applying",
        arm=arm.index + 1,
        num_arms=num_arms,
        arm_name=arm.name,
        seconds_left=_seconds_left(exp, arm, exp.warmup_seconds + exp.duration_seconds),
    )
    ids = [w.pk for w in workers]
    problems: dict[str, str] = {}

    def ready() -> bool:
        rows = list(
            Worker.objects.filter(pk__in=ids).values_list("name", "state", "running_revision_id", "apply_error")
        )
        for name, state, running, error in rows:
            if WorkerState(state).is_lost:
                problems[name] = f"worker {name} is {WorkerState(state).label}"
            elif error and running != revision.pk:
                problems[name] = f"worker {name} could not apply it: {error}"
        return bool(problems) or all(
            state == WorkerState.READY and running == revision.pk for _, state, running, _ in rows
        )

    if not _wait(lease, conf.EXPERIMENT_APPLY_TIMEOUT_SECONDS.get(), ready):
        raise ArmFailed(
            f"the workers were not ready on {revision.profile.name}@{revision.revision} after "
            f"{conf.EXPERIMENT_APPLY_TIMEOUT_SECONDS.get():g} s"
        )
    if problems:
        raise ArmFailed("; ".join(problems.values()))
    return list(Worker.objects.filter(pk__in=ids).order_by("name"))


Planner = Callable[..., list[loadgen.PlannedRequest]]


def planner(exp: Experiment, arm: Arm, workers: list[Worker]) -> Planner:
    """``plan(seed, seconds, rate_scale, num_requests=None)``: the workload's
    requests for one replay on these workers (their context length, the
    arm's block size): over ``seconds``, or ``num_requests`` of them."""
    spec = exp.workload.workload_spec()
    vocabulary = replay.vocabulary(conf.EXPERIMENT_TOKENIZER_DIR.get() or None)
    max_model_len = min((w.max_model_len for w in workers if w.max_model_len), default=None)
    block_size = int(arm.fields.get("block_size") or replay.DEFAULT_BLOCK_SIZE)
    num_caches = max(1, len(workers))  # one prefix cache per worker, each reset before the replay

    def plan(
        seed: int, seconds: float | None, rate_scale: float, num_requests: int | None = None
    ) -> list[loadgen.PlannedRequest]:
        return replay.sample(
            spec,
            vocabulary=vocabulary,
            seed=seed,
            duration_seconds=seconds,
            num_requests=num_requests,
            rate_scale=rate_scale,
            block_size=block_size,
            max_model_len=max_model_len,
            num_caches=num_caches,
        )

    return plan


def run_repeat(exp: Experiment, arm: Arm, workers: list[Worker], lease: Lease, num_arms: int, repeat: int) -> None:
    """Warm up, reset the prefix caches, replay repeat ``repeat`` (seed
    ``repeat``: the same requests for every arm) and store its result."""
    slos = exp.slos()
    urls = [w.url for w in workers]
    names = {w.url: w.name for w in workers}
    planned = planner(exp, arm, workers)

    def plan(seed: int, seconds: float) -> list[loadgen.PlannedRequest]:
        return planned(seed, seconds, exp.rate_scale)

    stage = f"repeat {repeat + 1} of {exp.repeats}"
    if exp.warmup_seconds > 0:
        _progress(exp, arm, num_arms, "warming up", exp.warmup_seconds + exp.duration_seconds)
        asyncio.run(
            replay_on(
                urls,
                plan(WARMUP_SEED, exp.warmup_seconds),
                lease,
                exp,
                arm,
                num_arms,
                "warming up",
                exp.warmup_seconds + exp.duration_seconds,
                names,
                slos,
            )
        )
    requests = drawn_or_failed(plan(repeat, exp.duration_seconds), exp)
    outcome = asyncio.run(
        replay_on(urls, requests, lease, exp, arm, num_arms, stage, exp.duration_seconds, names, slos, reset=True)
    )
    result = {
        "repeat": repeat,
        "attempt": arm.attempts,
        "taken_at": timezone.now().isoformat(),
        "arrival_seconds": exp.duration_seconds,
        "figures": measure.repeat_figures(outcome["client"], outcome["workers"]),
        "client": {
            k: outcome["client"][k]
            for k in (
                "num_requests",
                "successful_requests",
                "failed_requests",
                "duration_seconds",
                "total_input_tokens",
                "total_output_tokens",
            )
        },
    }
    with transaction.atomic():
        locked = Arm.objects.select_for_update().get(pk=arm.pk)
        if not any(r["repeat"] == repeat for r in locked.results):  # else taken meanwhile by a late runner
            locked.results = [*locked.results, result]
            locked.save(update_fields=["results"])
        arm.results = locked.results
    exp.changed()
    if outcome["dead"]:
        raise ArmFailed("; ".join(outcome["dead"]))


def run_ramp(exp: Experiment, arm: Arm, workers: list[Worker], lease: Lease, num_arms: int) -> None:
    """The capacity ramp, after the repeats: one replay per rate not yet
    taken, each stored as soon as it is (a resumed runner goes on at the
    next rate), until a rate misses; then the arm's capacity. A point is
    ``capacity_seconds`` of arrivals at its rate, and never fewer than
    RAMP_MIN_REQUESTS requests: a point with none would say nothing."""
    scales = [float(r) for r in exp.capacity_rate_scales or []]
    if not scales:
        return
    base_rate = exp.workload.workload_spec().rate_per_second * exp.rate_scale
    slos = exp.slos()
    urls = [w.url for w in workers]
    names = {w.url: w.name for w in workers}
    plan = planner(exp, arm, workers)
    while not ramp_finished([RampPoint.from_json(p) for p in arm.ramp], len(scales)):
        k = len(arm.ramp)
        rate = base_rate * scales[k]
        num = max(RAMP_MIN_REQUESTS, round(rate * exp.capacity_seconds))
        planned = plan(RAMP_SEED + k, None, exp.rate_scale * scales[k], num_requests=num)
        outcome = asyncio.run(
            replay_on(
                urls,
                planned,
                lease,
                exp,
                arm,
                num_arms,
                f"capacity ramp {k + 1} of {len(scales)}: {rate:.3g} req/s",
                (len(scales) - k) * exp.capacity_seconds,
                names,
                slos,
                reset=True,
            )
        )
        client = outcome["client"]
        point = {
            "index": k,
            "rate_scale": scales[k],
            "rate": rate,
            "attainment": client["slo_attainment"],
            "num_requests": client["num_requests"],
            "failed_requests": client["failed_requests"],
            "failure_reasons": client["failure_reasons"],
            "goodput": client["goodput"],
            "output_throughput": client["output_throughput"],
            **{
                f"client_{name}_p99": ms / 1000 if (ms := client[f"{name}_ms"]["p99"]) is not None else None
                for name in ("ttft", "tpot")
            },
            "attempt": arm.attempts,
            "taken_at": timezone.now().isoformat(),
        }
        with transaction.atomic():
            locked = Arm.objects.select_for_update().get(pk=arm.pk)
            if not any(p["index"] == k for p in locked.ramp):  # else taken meanwhile by a late runner: never twice
                locked.ramp = [*locked.ramp, point]
                locked.save(update_fields=["ramp"])
            arm.ramp = locked.ramp
        exp.changed()
        if outcome["dead"]:
            raise ArmFailed("; ".join(outcome["dead"]))
    arm.capacity = serving_capacity([RampPoint.from_json(p) for p in arm.ramp])
    Arm.objects.filter(pk=arm.pk).update(capacity=arm.capacity)


def _progress(exp: Experiment, arm: Arm, num_arms: int, stage: str, current_left: float) -> None:
    exp.set_progress(
        stage=stage,
        arm=arm.index + 1,
        num_arms=num_arms,
        arm_name=arm.name,
        seconds_left=_seconds_left(exp, arm, current_left),
    )


async def _scrape(session: aiohttp.ClientSession, url: str, *names: str) -> catalogue.Scrape:
    """A worker's figures; only the series ``names`` when given. The replay
    client shares this event loop and times every token on it: parsing a whole
    page (~25 ms on the tiny model) every few seconds stretched the stalls it
    measured to 2-3x those ``workers bench`` saw on the same workload."""
    params = [("name[]", n) for n in names]
    async with session.get(f"{url.rstrip('/')}/metrics", params=params) as r:
        r.raise_for_status()
        return catalogue.parse(await r.text())


async def _reset_prefix_cache(session: aiohttp.ClientSession, url: str) -> str:
    """Reset a worker's prefix cache; why it could not, or "". A worker
    still loading or applying the profile (503) is asked again, within the
    apply timeout."""
    deadline = time.monotonic() + conf.EXPERIMENT_APPLY_TIMEOUT_SECONDS.get()
    while True:
        async with session.post(f"{url.rstrip('/')}/reset_prefix_cache") as r:
            if r.status == 503 and time.monotonic() < deadline:
                await asyncio.sleep(POLL_SECONDS)
                continue
            if r.status == 404:
                return "has no /reset_prefix_cache (a worker older than this control plane): its arms cannot start cold"
            if r.status != 200:
                return f"could not reset its prefix cache: HTTP {r.status}: {(await r.text())[:200]}"
            if not (await r.json()).get("reset"):
                return "refused to reset its prefix cache (requests still held cached blocks)"
            return ""


async def replay_on(
    urls: list[str],
    planned: list[loadgen.PlannedRequest],
    lease: Lease,
    exp: Experiment,
    arm: Arm,
    num_arms: int,
    stage: str,
    left_seconds: float,
    names: dict[str, str],
    slos: dict[str, float],
    *,
    reset: bool = False,
) -> dict[str, Any]:
    """Replay ``planned`` (round-robin over the workers, as their pool would
    share it) and measure; the lease is renewed and the abort flag read
    every second meanwhile. ``reset``: every worker's prefix cache is reset
    first; a worker that cannot reset it is out, with the reason."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="experiment-db")
    loop = asyncio.get_running_loop()

    async def db(fn: Callable[[], T]) -> T:
        return await loop.run_in_executor(executor, fn)

    timeout = aiohttp.ClientTimeout(total=30)
    session = aiohttp.ClientSession(timeout=timeout)
    clients: dict[str, loadgen.Client] = {}
    dead: dict[str, str] = {}
    peaks: list[float] = []
    try:
        before: dict[str, catalogue.Scrape] = {}
        for url in urls:
            try:
                client = clients[url] = loadgen.Client(url, model=None, api_key=None)
                client.model, _ = await client.discover()
                if reset and (why := await _reset_prefix_cache(session, url)):
                    dead[url] = f"worker {names[url]} {why}"
                    continue
                before[url] = await _scrape(session, url)
            except (aiohttp.ClientError, TimeoutError, IndexError, KeyError, ValueError) as exc:
                dead[url] = f"worker {names[url]} stopped answering: {type(exc).__name__}: {exc}"
        live_urls = [u for u in urls if u not in dead]
        if not live_urls:
            return {"client": loadgen.summarize([], 0.0, slos), "workers": {}, "dead": list(dead.values())}
        shares: dict[str, list[loadgen.PlannedRequest]] = {u: [] for u in live_urls}
        for i, req in enumerate(planned):
            shares[live_urls[i % len(live_urls)]].append(req)
        started = time.monotonic()
        runs = [asyncio.ensure_future(loadgen.replay(clients[u], shares[u])) for u in live_urls]

        async def monitor() -> None:
            tick = 0
            while True:
                await asyncio.sleep(1.0)
                tick += 1
                if await db(lease.renew):
                    raise Aborted()
                if tick % 3 == 0:
                    for u in live_urls:
                        try:
                            peaks.append(measure.peak_memory(await _scrape(session, u, catalogue.PEAK_MEMORY)))
                        except (aiohttp.ClientError, TimeoutError):
                            pass
                left = max(0.0, left_seconds - (time.monotonic() - started))
                await db(lambda left=left: _progress(exp, arm, num_arms, stage, left))  # type: ignore[misc]

        watcher = asyncio.ensure_future(monitor())
        done = asyncio.gather(*runs)
        finished, _ = await asyncio.wait([done, watcher], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        if watcher in finished:
            done.cancel()
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            watcher.result()  # raises Aborted or LeaseLost
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        outcomes = done.result()
        records = [rec for recs, _ in outcomes for rec in recs]
        wall = max(w for _, w in outcomes)
        pairs = []
        for u in live_urls:
            try:
                after = await _scrape(session, u)
                peaks.append(measure.peak_memory(after))
                pairs.append((before[u], after))
            except (aiohttp.ClientError, TimeoutError) as exc:
                dead[u] = f"worker {names[u]} stopped answering during the arm: {type(exc).__name__}: {exc}"
        return {
            "client": loadgen.summarize(records, wall, slos),
            "workers": measure.worker_figures(pairs, peaks),
            "dead": list(dead.values()),
        }
    finally:
        for client in clients.values():
            await client.close()
        await session.close()
        await loop.run_in_executor(executor, lambda: connection.close())  # this thread's connection
        executor.shutdown(wait=True)


# ---- 3. back to traffic ------------------------------------------------------------------------


def to_restoring(exp: Experiment) -> None:
    with transaction.atomic():
        exp = Experiment.objects.select_for_update().get(pk=exp.pk)
        exp.phase = Phase.RESTORING
        exp.message = "aborting: restoring the workers" if exp.abort_requested else "restoring the workers"
        exp.save(update_fields=["phase", "message"])
        exp.changed()


def restore(exp: Experiment, lease: Lease) -> None:
    """Every worker back on its previous override and cordon; then wait
    (bounded) until the live ones run their revision again."""
    now = timezone.now()
    ids = []
    for key, prev in (exp.previous or {}).items():
        with transaction.atomic():
            w = Worker.objects.select_for_update(of=("self",)).select_related("pool").filter(pk=int(key)).first()
            if w is None:
                continue
            ids.append(w.pk)
            before = w.audit_state()
            revision = (
                ProfileRevision.objects.filter(pk=prev.get("desired_revision")).first()
                if prev.get("desired_revision")
                else None
            )
            if w.desired_revision_id != (revision.pk if revision else None):
                w.set_desired_revision(revision, now=now)
            if w.cordoned != bool(prev.get("cordoned")):
                w.set_flags(cordoned=bool(prev.get("cordoned")))
            after = w.audit_state()
            if after != before:
                audit.record(exp.actor, "worker.restore", w, before, after, time=now)
    exp.set_progress(stage="restoring", arm=exp.arms.count(), num_arms=exp.arms.count(), seconds_left=0)

    def back() -> bool:
        for w in Worker.objects.filter(pk__in=ids).select_related("pool"):
            if not WorkerState(w.state).is_lost and w.running_revision_id != w.effective_desired_revision_id():
                return False
        return True

    try:
        _wait(lease, conf.EXPERIMENT_APPLY_TIMEOUT_SECONDS.get(), back)
    except Aborted:
        pass  # already restoring: the flag changes nothing now


def finish(exp: Experiment, phase: Phase, message: str = "") -> None:
    """The recommendation on the arms that ran, and the phase; ``message``
    says how it ended (default: aborted with the reason, or finished)."""
    with transaction.atomic():
        exp = Experiment.objects.select_for_update().get(pk=exp.pk)
        exp.arms.filter(status__lt=ArmStatus.SUCCEEDED).update(
            status=ArmStatus.SKIPPED, error="the experiment was aborted first"
        )
        rec = recommendation(exp)
        before = exp.audit_state()
        exp.recommendation = rec
        exp.phase, exp.finished_at = phase, timezone.now()
        exp.message = message or (
            ("aborted: " + exp.abort_reason) if phase == Phase.ABORTED else "finished; workers restored"
        )
        exp.progress = {"stage": phase.label, "seconds_left": 0}
        exp.save(update_fields=["recommendation", "phase", "finished_at", "message", "progress"])
        audit.record(exp.actor, f"experiment.{phase.label}", exp, before, {**exp.audit_state(), "recommendation": rec})
        exp.changed()


def arm_figures(exp: Experiment, arm: Arm) -> ArmFigures:
    """An arm's figures for the recommendation, one value per repeat in
    repeat order, and whether its conditions were the workload's."""
    results = sorted(arm.results, key=lambda r: r["repeat"])
    figures = [measure.upgrade_figures(r["figures"]) for r in results]

    def values(key: str) -> list[float]:
        return [f[key] for f in figures if f.get(key) is not None]

    conditions = arm.conditions(exp)
    return ArmFigures(
        arm.name,
        values("goodput"),
        values("output_throughput"),
        values("client_ttft_p99"),
        values("client_tpot_p99"),
        values("client_stall_p99"),
        capacity=[arm.capacity] if arm.capacity is not None else [],
        failed=arm.error if arm.status == ArmStatus.FAILED else "",
        not_comparable="; ".join(conditions.not_comparable),
    )


def objectives(exp: Experiment) -> Objectives:
    o = exp.objectives or {}
    return Objectives(
        ttft_p99_seconds=float(o.get("ttft_ms", 2000)) / 1000,
        tpot_p99_seconds=float(o.get("tpot_ms", 200)) / 1000,
        stall_p99_seconds=float(o["stall_ms"]) / 1000 if o.get("stall_ms") else None,
    )


def judge(exp: Experiment) -> Recommendation | None:
    """The recommendation on the arms that ran; None when none did."""
    arms = [arm_figures(exp, arm) for arm in exp.arms.order_by("index") if arm.status != ArmStatus.SKIPPED]
    if not arms:
        return None
    return recommend(arms, objectives(exp), baseline=exp.baseline or None)


def recommendation(exp: Experiment) -> dict[str, Any]:
    rec = judge(exp)
    if rec is None:
        return {
            "winner": None,
            "outcome": "none_met",
            "outcome_label": "no arm qualifies",
            "basis": "goodput",
            "reasons": ["no arm ran"],
            "broke": {},
            "tied": [],
        }
    return rec.to_json()
