"""The reconciler: reads a rollout and the world, asks the evaluator what to
do, does it, records it. One workflow across rollouts, pools, workers, the
routing table and analysis runs.

Design note. ``drive(rollout_id)`` runs ticks back to back. Each ``tick`` is
one short transaction that holds the rollout's row lock (``select_for_update``
in ``atomic``): re-read the row and the world, ``evaluate``, apply the
decision (status, cleared flags, timeline, audit) and perform its one
action. Slow waits happen *between* ticks, outside the lock, so a button's
conditional update never queues behind a reconcile for long:

* gateway acks: waited for in-process (Redis pub/sub), in short slices that
  look at the abort flag, up to ROLLOUT_ACK_WAIT_SECONDS;
* the consistency gate: HTTP replays on two workers, then a short locked
  write of the verdict (only if the attempt is still waiting for it).

Scheduling. Every tick writes a fresh ``schedule_token`` and how long it may
keep the rollout busy (``next_run_at``). When a task stops ticking it
enqueues its successor with that token and a countdown, after commit. A task
whose token is no longer the row's was superseded (a button kicked a newer
run) and exits without work, so concurrent runs collapse into one chain. A
task lost with its worker leaves ``next_run_at`` in the past, and the beat
sweeper restarts the rollout.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from controlplane import audit
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway import bus
from controlplane.gateway.models import RoutingTable
from controlplane.profiles.models import ProfileRevision
from controlplane.rollouts import conf, gate, measure, notifications
from controlplane.rollouts.evaluator import (
    IDLE_POLL_SECONDS,
    WORKER_POLL_SECONDS,
    Act,
    Action,
    AnalysisView,
    Decision,
    GateStatus,
    Phase,
    PoolView,
    Wait,
    WorkerView,
    World,
    evaluate,
)
from controlplane.rollouts.judge import AnalysisPhase, next_measurement_at, take_round
from controlplane.rollouts.models import (
    FLAG_FIELDS,
    AnalysisRun,
    AnalysisTemplate,
    Measurement,
    Rollout,
)
from controlplane.rollouts.steps import Analysis

log = logging.getLogger(__name__)

# Events worth an audit row of their own: the automatic decisions.
AUDITED_EVENTS = {
    "started",
    "aborting",
    "aborted",
    "promoting",
    "succeeded",
    "paused",
    "promoted",
    "step_skipped",
    "step_completed",
    "retry",
    "gate_passed",
    "gate_failed",
    "analysis_completed",
}


@dataclass(frozen=True)
class TickOutcome:
    token: str
    decision: Decision
    attempt: int
    awaiting_epoch: tuple[int, int] | None = None  # (table id, epoch) to wait for
    run_gate: bool = False
    failed: bool = False

    @property
    def continue_now(self) -> bool:
        return not self.failed and self.decision.requeue_seconds == 0


# ---- the loop ------------------------------------------------------------------------------


def drive(rollout_id: int, token: str | None = None) -> None:
    """Tick until there is something to wait for, then hand over to the
    next scheduled run. ``token`` None: a kick (always runs)."""
    for _ in range(conf.ROLLOUT_MAX_TICKS_PER_TASK.get()):
        out = tick(rollout_id, token)
        if out is None:
            return
        token = out.token
        if out.run_gate:
            if run_gate(rollout_id, out.attempt):
                continue
            schedule(rollout_id, token, WORKER_POLL_SECONDS)
            return
        if out.awaiting_epoch is not None:
            if await_acks(rollout_id, *out.awaiting_epoch, budget_seconds=conf.ROLLOUT_ACK_WAIT_SECONDS.get()):
                continue
            schedule(rollout_id, token, out.decision.requeue_seconds or WORKER_POLL_SECONDS)
            return
        if out.continue_now:
            continue
        if out.decision.phase.finished:
            return
        delay = WORKER_POLL_SECONDS if out.failed else out.decision.requeue_seconds
        # Never further out than the idle tick: a countdown longer than the
        # broker's visibility timeout would be redelivered meanwhile anyway.
        schedule(rollout_id, token, IDLE_POLL_SECONDS if delay is None else min(delay, IDLE_POLL_SECONDS))
        return
    if token is not None:
        schedule(rollout_id, token, 0.0)


def schedule(rollout_id: int, token: str, delay_seconds: float) -> bool:
    """Enqueue the successor run, unless a newer run took over meanwhile."""
    # Imported here: tasks.py imports this module.
    from controlplane.rollouts.tasks import reconcile

    delay_seconds = max(0.0, delay_seconds)
    with transaction.atomic():
        claimed = Rollout.objects.filter(pk=rollout_id, schedule_token=token, phase__lt=Phase.ABORTED).update(
            next_run_at=timezone.now() + timedelta(seconds=delay_seconds)
        )
        if claimed:
            transaction.on_commit(
                lambda: reconcile.apply_async((rollout_id,), {"token": token}, countdown=delay_seconds)
            )
    return bool(claimed)


def await_acks(rollout_id: int, table_id: int, epoch: int, *, budget_seconds: float) -> bool:
    """Wait for every live gateway's ack of ``epoch``. True when they all
    acked, or when an abort came in meanwhile (so the next tick runs now)."""
    deadline = time.monotonic() + budget_seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if bus.wait_for_acks(table_id, epoch, min(0.25, remaining)).complete:
            return True
        if Rollout.objects.filter(pk=rollout_id, abort_requested=True, phase__lt=Phase.ABORTING).exists():
            return True


# ---- one tick ------------------------------------------------------------------------------


def tick(rollout_id: int, token: str | None = None, *, now: datetime | None = None) -> TickOutcome | None:
    """One locked read-decide-act. None: the rollout is gone, or this run
    was superseded by a newer one."""
    with transaction.atomic():
        rollout = Rollout.objects.select_for_update(of=("self",)).with_related().filter(pk=rollout_id).first()
        if rollout is None or (token is not None and rollout.schedule_token != token):
            return None
        now = now or timezone.now()
        world = observe(rollout, now)
        decision = evaluate(rollout.state(), world, now)
        notices = apply(rollout, decision, now)
        failed = False
        if decision.action is not None and decision.action.kind != Act.RUN_GATE:
            error = perform(rollout, decision.action, world, now)
            failed = error is not None
            if error is None:
                rollout.last_error = ""
            elif error != rollout.last_error:
                rollout.last_error = error
                rollout.record("action_failed", f"{decision.action.kind.value} failed: {error}")
            else:
                rollout.last_error = error
        if decision.progressed and not failed and (decision.action is None or decision.action.kind != Act.RUN_GATE):
            rollout.progress_at = now
        rollout.schedule_token = uuid.uuid4().hex
        hold = (
            conf.ROLLOUT_GATE_TIMEOUT_SECONDS.get()
            if decision.action and decision.action.kind == Act.RUN_GATE
            else conf.ROLLOUT_ACK_WAIT_SECONDS.get() + 5.0
        )
        rollout.next_run_at = None if rollout.is_finished else now + timedelta(seconds=hold)
        rollout.updated_at = now
        rollout.save()
        # After the action's own on-commit work (the gateways' routing notice
        # above all): pages and pagers may wait, the gateways may not.
        rollout.changed()
        for kind, message in notices:
            notifications.notify(rollout, kind, message)
        awaiting = None
        if decision.wait == Wait.ACKS:
            table = rollout.routing_table
            table.refresh_from_db(fields=["epoch"])
            awaiting = (table.pk, table.epoch)
        return TickOutcome(
            token=rollout.schedule_token,
            decision=decision,
            attempt=rollout.attempt,
            awaiting_epoch=awaiting,
            run_gate=decision.action is not None and decision.action.kind == Act.RUN_GATE,
            failed=failed,
        )


def observe(rollout: Rollout, now: datetime) -> World:
    table = RoutingTable.objects.get(pk=rollout.routing_table_id)
    try:
        acked = bus.ack_status(table.pk, table.epoch).complete
    except Exception:
        log.warning("rollout %s: cannot read gateway acks", rollout.pk, exc_info=True)
        acked = False
    return World(
        weights=table.weights(),
        acked=acked,
        canary=pool_view(rollout.canary_pool_id),
        stable=pool_view(rollout.stable_pool_id),
        analysis=analysis_view(rollout),
    )


def pool_view(pool_id: int) -> PoolView:
    desired = Pool.objects.filter(pk=pool_id).values_list("desired_revision_id", flat=True).first()
    workers = tuple(
        WorkerView(
            id=wid,
            name=name,
            override_revision=override,
            running_revision=running,
            ready=state == WorkerState.READY,
            live=not WorkerState(state).is_lost,
        )
        for wid, name, override, running, state in Worker.objects.filter(pool_id=pool_id)
        .order_by("name")
        .values_list("id", "name", "desired_revision_id", "running_revision_id", "state")
    )
    return PoolView(desired, workers)


def analysis_view(rollout: Rollout) -> AnalysisView | None:
    if not isinstance(rollout.current_step(), Analysis):
        return None
    run = rollout.current_analysis()
    if run is None:
        return None
    last = run.measurements.order_by("-taken_at").values_list("taken_at", flat=True).first()
    due = None if AnalysisPhase(run.phase).completed else next_measurement_at(run.run_spec(), run.started_at, last)
    return AnalysisView(AnalysisPhase(run.phase), run.message, due)


# ---- applying a decision -------------------------------------------------------------------


def apply(rollout: Rollout, d: Decision, now: datetime) -> list[tuple[str, str]]:
    """Write the decision's status, flags and timeline onto the row (not
    saved). Returns the (kind, message) of each event, for notifications."""
    before = Phase(rollout.phase)
    if d.terminate_analysis:
        run = rollout.current_analysis()
        if run is not None and not AnalysisPhase(run.phase).completed and not run.terminated:
            run.terminated, run.finished_at = True, now
            run.message = f"{run.message}; terminated" if run.message else "terminated"
            run.save(update_fields=["terminated", "finished_at", "message"])
    for flag in d.clear_flags:
        setattr(rollout, FLAG_FIELDS[flag], False)
    if d.new_attempt:
        rollout.attempt += 1
        rollout.gate_status = GateStatus.PENDING if rollout.gate_required() else GateStatus.SKIPPED
        rollout.gate_result = {}
        rollout.last_error = ""
        rollout.finished_at = None
        rollout.progress_at = now
    rollout.phase = int(d.phase)
    rollout.step_index = d.step_index
    rollout.step_started_at = d.step_started_at
    rollout.pause_conditions = [{"reason": c.reason.value, "since": c.since.isoformat()} for c in d.pause_conditions]
    rollout.message = d.message
    rollout.abort_reason = d.abort_reason
    if before == Phase.PENDING and d.phase > Phase.PENDING and rollout.started_at is None:
        rollout.started_at = now
    if d.phase.finished and not before.finished:
        rollout.finished_at = now
    for event in d.events:
        rollout.record(event.kind, event.message, now=now)
        if event.kind in AUDITED_EVENTS:
            audit.record(
                rollout.actor,
                f"rollout.{event.kind}",
                rollout,
                {"phase": before.label},
                {"phase": d.phase.label, "step_index": d.step_index, "message": event.message},
                time=now,
            )
    return [(event.kind, event.message) for event in d.events]


def perform(rollout: Rollout, action: Action, world: World, now: datetime) -> str | None:
    """Do the decision's one action. Returns why it failed, or None."""
    try:
        with transaction.atomic():
            handler = _HANDLERS[action.kind]
            handler(rollout, action, world, now)
    except ValidationError as exc:
        return (
            "; ".join(m for messages in exc.message_dict.values() for m in messages)
            if hasattr(exc, "error_dict")
            else "; ".join(exc.messages)
        )
    return None


def _describe_weights(weights: dict[str, int]) -> str:
    return ", ".join(f"{role} {bp / 100:g}%" for role, bp in weights.items())


def _set_weights(rollout: Rollout, action: Action, world: World, now: datetime) -> None:
    assert action.weights is not None
    table = rollout.routing_table
    text = _describe_weights(action.weights)
    epoch = table.set_weights(
        action.weights,
        actor=rollout.actor,
        reason=f"rollout {rollout.pk}: {rollout.message}",
        require_ready=action.require_ready,
        now=now,
    )
    rollout.weights = table.weights()
    rollout.record(
        "weights_set", f"weights set: {text} (epoch {epoch})", data={"weights": action.weights, "epoch": epoch}, now=now
    )


def _point_pool(rollout: Rollout, pool_id: int, revision_id: int, now: datetime, kind: str, what: str) -> None:
    """Point a whole pool at a revision and clear its workers' overrides."""
    pool = Pool.objects.select_for_update().get(pk=pool_id)
    revision = ProfileRevision.objects.select_related("profile").get(pk=revision_id)
    # Going back to the stable revision is never refused: the pool ran it.
    errors = pool.revision_errors(revision) if revision.pk != rollout.stable_revision_id else {}
    if errors:
        raise ValidationError(errors)
    before = {
        "desired_revision": pool.desired_revision_id,
        "overrides": dict(pool.workers.exclude(desired_revision=None).values_list("name", "desired_revision")),
    }
    pool.set_desired_revision(revision, now=now)
    for worker in pool.workers.exclude(desired_revision=None):
        worker.set_desired_revision(None, now=now)
    audit.record(
        rollout.actor, "pool.set_revision", pool, before, {"desired_revision": revision.pk, "overrides": {}}, time=now
    )
    rollout.record(
        kind, f"{what}: pool {pool.name} → {revision}", data={"pool": pool.name, "revision": revision.pk}, now=now
    )


def _set_canary_revision(rollout: Rollout, action: Action, world: World, now: datetime) -> None:
    assert action.revision is not None
    _point_pool(rollout, rollout.canary_pool_id, action.revision, now, "canary_revision", "canary pool")


def _finalize_pool(rollout: Rollout, action: Action, world: World, now: datetime) -> None:
    assert action.revision is not None
    _point_pool(rollout, rollout.stable_pool_id, action.revision, now, "pool_finalized", "stable pool")


def _move_worker(rollout: Rollout, action: Action, world: World, now: datetime) -> None:
    assert action.worker_id is not None and action.revision is not None
    worker = Worker.objects.select_for_update(of=("self",)).select_related("pool").get(pk=action.worker_id)
    revision = ProfileRevision.objects.select_related("profile").get(pk=action.revision)
    errors = worker.revision_errors(revision) if revision.pk != rollout.stable_revision_id else {}
    if errors:
        raise ValidationError(errors)
    before = worker.audit_state()
    worker.set_desired_revision(revision, now=now)
    audit.record(rollout.actor, "worker.move", worker, before, worker.audit_state(), time=now)
    rollout.record(
        "worker_moved",
        f"worker {worker.name} → {revision} (one at a time)",
        data={"worker": worker.name, "revision": revision.pk},
        now=now,
    )


def _start_analysis(rollout: Rollout, action: Action, world: World, now: datetime) -> None:
    (canary, _), (baseline, _) = measure.sides(rollout)
    template = AnalysisTemplate.objects.filter(name=action.template).first()
    defaults: dict[str, Any] = {
        "template_name": action.template or "",
        "canary_pool_name": canary,
        "baseline_pool_name": baseline,
        "started_at": now,
    }
    if template is None:
        defaults.update(
            spec={"metrics": []},
            phase=AnalysisPhase.ERROR,
            finished_at=now,
            message=f"analysis template `{action.template}` does not exist",
        )
    else:
        defaults.update(spec=template.spec().to_json(), phase=AnalysisPhase.PENDING, message="starting")
    run, created = AnalysisRun.objects.get_or_create(
        rollout=rollout, attempt=rollout.attempt, step_index=rollout.step_index, defaults=defaults
    )
    if created:
        rollout.record(
            "analysis_started",
            f"analysis `{run.template_name}` started: canary {canary} against {baseline}",
            data={"run": run.pk},
            now=now,
        )


def _measure(rollout: Rollout, action: Action, world: World, now: datetime) -> None:
    run = AnalysisRun.objects.select_for_update().get(
        rollout=rollout, attempt=rollout.attempt, step_index=rollout.step_index
    )
    if AnalysisPhase(run.phase).completed:
        return
    spec = run.run_spec()
    since_start = (now - run.started_at).total_seconds()
    lookback = spec.lookback_at(since_start)
    samples = measure.collect(rollout, spec, world.weights, now, lookback_seconds=lookback)
    outcome = take_round(spec, run.metric_results(), samples, since_start)
    verdicts = [outcome.verdicts[rule.name].to_json(rule, samples[rule.name]) for rule in spec.metrics]
    Measurement.objects.create(
        run=run,
        taken_at=now,
        window_seconds=lookback,
        phase=outcome.worst,
        verdicts=verdicts,
        weights=dict(world.weights),
    )
    run.results = {name: result.to_json() for name, result in outcome.results.items()}
    run.phase, run.message = outcome.phase, outcome.message
    if outcome.phase.completed:
        run.finished_at = now
    run.save(update_fields=["results", "phase", "message", "finished_at"])
    num = run.measurements.count()
    summary = ", ".join(f"{v['metric']} {v['phase']}" for v in verdicts)
    counted = "" if outcome.counted else ", not counted: " + outcome.message
    rollout.record(
        "measurement",
        f"measurement {num}/{spec.count}: {outcome.worst.label} ({summary}){counted}",
        data={"run": run.pk, "verdicts": verdicts},
        now=now,
    )
    if outcome.phase.completed:
        rollout.record(
            "analysis_completed",
            f"analysis `{run.template_name}` {outcome.phase.label}: {outcome.message}",
            data={"run": run.pk},
            now=now,
        )
        audit.record(
            rollout.actor,
            f"rollout.analysis_{outcome.phase.label}",
            rollout,
            None,
            {"run": run.pk, "message": outcome.message, "verdicts": verdicts},
            time=now,
        )


_HANDLERS = {
    Act.SET_WEIGHTS: _set_weights,
    Act.SET_CANARY_REVISION: _set_canary_revision,
    Act.MOVE_WORKER: _move_worker,
    Act.FINALIZE_POOL: _finalize_pool,
    Act.START_ANALYSIS: _start_analysis,
    Act.MEASURE: _measure,
}


# ---- the consistency gate (outside the lock) ---------------------------------------------------


def run_gate(rollout_id: int, attempt: int) -> bool:
    """Replay the gate's prompts on a canary and a stable worker, then record
    the verdict. False when the replay could not be made (the error is on
    the timeline; the next tick tries again, within the progress deadline).
    Prompts that crossed too few chunk boundaries fail the gate (the rollout
    aborts before any traffic): another try replays the same prompts."""
    rollout = Rollout.objects.select_related("target_revision", "stable_revision").filter(pk=rollout_id).first()
    if rollout is None or rollout.attempt != attempt or rollout.gate_status != GateStatus.PENDING:
        return True
    ready = Worker.objects.filter(state=WorkerState.READY)
    canary = ready.filter(pool_id=rollout.canary_pool_id, running_revision_id=rollout.target_revision_id).first()
    stable_pools = [p for p in (rollout.baseline_pool_id, rollout.stable_pool_id) if p is not None]
    stable = next(
        (
            w
            for pool_id in stable_pools
            for w in ready.filter(pool_id=pool_id, running_revision_id=rollout.stable_revision_id)[:1]
        ),
        None,
    )
    if canary is None or stable is None:
        return _gate_error(rollout_id, attempt, "no ready canary and stable worker to replay on")
    settings = rollout.gate_settings()
    profile = rollout.target_revision.engine_profile()
    # The shorter context of the two (0: neither said).
    max_model_len = min((n for n in (canary.max_model_len, stable.max_model_len) if n), default=0)
    short = profile.short_prompt_threshold
    prompts: list[gate.Prompt] = list(settings.prompts)
    if not prompts:
        prompts.extend(gate.default_prompts(profile.chunk_cap, max_model_len, settings.max_tokens, short))
    try:
        outcome = gate.run(
            canary.url,
            stable.url,
            prompts,
            settings.max_tokens,
            profile.chunk_cap,
            timeout_seconds=conf.ROLLOUT_GATE_TIMEOUT_SECONDS.get(),
            min_boundaries=gate.required_boundaries(profile.chunk_cap, max_model_len, settings.max_tokens, short),
            short_prompt_threshold=short,
        )
    except gate.GateError as exc:
        return _gate_error(rollout_id, attempt, str(exc))
    details = {
        **outcome.details,
        "message": outcome.message,
        "error": outcome.error,
        "canary_worker": canary.name,
        "stable_worker": stable.name,
    }
    with transaction.atomic():
        rollout = (
            Rollout.objects.select_for_update()
            .filter(pk=rollout_id, attempt=attempt, gate_status=GateStatus.PENDING, phase__lt=Phase.ABORTING)
            .first()
        )
        if rollout is None:
            return True
        now = timezone.now()
        rollout.gate_status = GateStatus.PASSED if outcome.passed else GateStatus.FAILED
        rollout.gate_result = details
        rollout.last_error = ""
        rollout.progress_at = now
        rollout.save(update_fields=["gate_status", "gate_result", "last_error", "progress_at"])
        kind = "gate_passed" if outcome.passed else "gate_failed"
        verdict = "passed" if outcome.passed else ("could not show anything" if outcome.error else "failed")
        rollout.record(kind, f"consistency gate {verdict}: {outcome.message}", data=details, now=now)
        audit.record(rollout.actor, f"rollout.{kind}", rollout, None, details, time=now)
        rollout.changed()
    return True


def _gate_error(rollout_id: int, attempt: int, message: str) -> bool:
    with transaction.atomic():
        rollout = Rollout.objects.select_for_update().filter(pk=rollout_id, attempt=attempt).first()
        if rollout is not None and rollout.last_error != f"consistency gate: {message}":
            rollout.last_error = f"consistency gate: {message}"
            rollout.save(update_fields=["last_error"])
            rollout.record("action_failed", f"the consistency gate could not run: {message}")
            rollout.changed()
    return False
