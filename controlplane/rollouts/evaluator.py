"""The rollout step evaluator: stored state + what the world looks like now +
the flags buttons set → the one next thing to do. Pure: no Django, no I/O.

Design note. ``evaluate()`` is called on every reconcile tick with a fresh
``RolloutState`` (the row) and ``World`` (routing weights and acks, the
canary and stable pools, the current analysis run) and returns a
``Decision``: the new status fields, at most one ``Action`` for the
controller to perform, what it waits for and when to look again. Doing one
idempotent thing per tick and re-reading the truth before the next is what
makes a tick safe to run twice (Argo Rollouts' reconcile loop).

The phases, in order (``phase >= ABORTED`` means finished):

  PENDING → PROGRESSING ⇄ PAUSED → PROMOTING → SUCCEEDED
                 └──────────┴──────────┴──→ ABORTING → ABORTED (retry → PROGRESSING)

It runs in labelled stages:

  1. Finished: only ``retry`` (of an aborted rollout) does anything.
  2. Abort first: the flag wins over everything else, in every phase.
  3. Promote-full: skip what is left of the plan.
  4. Preparation: the canary pool runs the target revision, every live
     canary worker reports it ready, and the consistency gate has passed
     (for a chunked target) — all before any traffic reaches it.
  5. The current step: set_weight (done when the table holds the weights
     and every live gateway has acked them), pause, analysis.
  6. Promotion, abort: see ``_promoting`` and ``_aborting``.

Waiting on infrastructure (workers applying a revision, gateway acks) counts
against the progress deadline; pauses and analyses do not (they are
progress). A deadline passed while progressing aborts; while aborting it
stops waiting and finishes, saying what was left undone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import IntEnum, StrEnum

from controlplane.rollouts.judge import AnalysisPhase
from controlplane.rollouts.steps import ALL_TRAFFIC_BP, Analysis, Pause, SetWeight, Step

ACK_POLL_SECONDS = 0.5
WORKER_POLL_SECONDS = 1.0
IDLE_POLL_SECONDS = 30.0  # a safety tick while a person is awaited: buttons also kick


class Phase(IntEnum):
    PENDING = 0
    PROGRESSING = 1
    PAUSED = 2
    PROMOTING = 3
    ABORTING = 4
    ABORTED = 5
    SUCCEEDED = 6

    @property
    def finished(self) -> bool:
        return self >= Phase.ABORTED

    @property
    def label(self) -> str:
        return self.name.lower()


class PauseReason(StrEnum):
    PAUSE_STEP = "pause_step"  # Argo's CanaryPauseStep
    INCONCLUSIVE = "inconclusive_analysis"  # Argo's InconclusiveAnalysis


class GateStatus(StrEnum):
    PENDING = "pending"  # required, not yet run for this attempt
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"  # the target is not chunked, or the gate is off


class Act(StrEnum):
    SET_WEIGHTS = "set_weights"
    SET_CANARY_REVISION = "set_canary_revision"  # the whole canary pool at once (it carries no traffic)
    MOVE_WORKER = "move_worker"  # one stable worker's override to the revision
    FINALIZE_POOL = "finalize_pool"  # the stable pool's revision, overrides cleared
    RUN_GATE = "run_gate"
    START_ANALYSIS = "start_analysis"
    MEASURE = "measure"


class Wait(StrEnum):
    ACKS = "acks"
    CANARY = "canary"
    STABLE_WORKER = "stable_worker"
    CANARY_BACK = "canary_back"
    MEASUREMENT = "measurement"
    PAUSE = "pause"
    PERSON = "person"


@dataclass(frozen=True)
class PauseCondition:
    reason: PauseReason
    since: datetime


@dataclass(frozen=True)
class Flags:
    abort: bool = False
    promote: bool = False
    promote_full: bool = False
    skip_step: bool = False
    retry: bool = False

    def raised(self) -> frozenset[str]:
        return frozenset(name for name in self.__dataclass_fields__ if getattr(self, name))


@dataclass(frozen=True)
class RolloutState:
    phase: Phase
    steps: tuple[Step, ...]
    step_index: int
    step_started_at: datetime | None
    pause_conditions: tuple[PauseCondition, ...]
    flags: Flags
    stable_revision: int
    target_revision: int
    gate: GateStatus
    progress_at: datetime
    progress_deadline_seconds: float
    fast_track: bool = False
    has_baseline: bool = False
    abort_reason: str = ""
    gate_message: str = ""  # what the gate found, when it failed
    last_error: str = ""  # the last action failed, and why (the controller retries it)


@dataclass(frozen=True)
class WorkerView:
    id: int
    name: str
    override_revision: int | None  # its own desired revision; None: the pool's
    running_revision: int | None
    ready: bool  # reports ready (its engine serves)
    live: bool  # heard from lately: a lost worker is not waited for


@dataclass(frozen=True)
class PoolView:
    desired_revision: int | None
    workers: tuple[WorkerView, ...] = ()

    def effective(self, worker: WorkerView) -> int | None:
        return worker.override_revision if worker.override_revision is not None else self.desired_revision

    @property
    def live(self) -> list[WorkerView]:
        return [w for w in self.workers if w.live]

    @property
    def has_overrides(self) -> bool:
        return any(w.override_revision is not None for w in self.workers)

    def points_at(self, revision: int) -> bool:
        return self.desired_revision == revision and not self.has_overrides

    def all_live_on(self, revision: int) -> bool:
        return all(w.running_revision == revision and w.ready for w in self.live)

    def ready_on(self, revision: int) -> bool:
        """At least one live worker, and every live one runs ``revision``, ready."""
        return bool(self.live) and self.all_live_on(revision)


class MoveKind(StrEnum):
    DONE = "done"
    WAIT = "wait"
    MOVE = "move"
    FINALIZE = "finalize"


@dataclass(frozen=True)
class Move:
    kind: MoveKind
    worker: WorkerView | None = None


def pool_move(pool: PoolView, revision: int) -> Move:
    """The next step of moving a pool that carries traffic to ``revision``
    one worker at a time: wait for the worker being moved to report ready
    on it, else move the next (by name), else point the pool at it and
    clear the overrides. Lost workers are skipped; they pick up the pool's
    revision when they come back."""
    live = sorted(pool.live, key=lambda w: w.name)
    settling = [w for w in live if pool.effective(w) == revision and not (w.running_revision == revision and w.ready)]
    if pool.points_at(revision):
        return Move(MoveKind.WAIT, settling[0]) if settling else Move(MoveKind.DONE)
    if settling:
        return Move(MoveKind.WAIT, settling[0])
    todo = [w for w in live if pool.effective(w) != revision]
    if todo:
        return Move(MoveKind.MOVE, todo[0])
    return Move(MoveKind.FINALIZE)


@dataclass(frozen=True)
class AnalysisView:
    phase: AnalysisPhase
    message: str
    next_measurement_at: datetime | None


@dataclass(frozen=True)
class World:
    weights: dict[str, int]  # role → basis points, as the routing table holds them now
    acked: bool  # every live gateway has applied the table's current epoch
    canary: PoolView
    stable: PoolView
    analysis: AnalysisView | None = None  # the current step's run, once started


@dataclass(frozen=True)
class Action:
    kind: Act
    weights: dict[str, int] | None = None
    require_ready: bool = True
    revision: int | None = None
    worker_id: int | None = None
    template: str | None = None


@dataclass(frozen=True)
class Event:
    kind: str
    message: str


@dataclass
class Decision:
    phase: Phase
    step_index: int
    step_started_at: datetime | None
    pause_conditions: tuple[PauseCondition, ...]
    message: str
    abort_reason: str
    action: Action | None = None
    wait: Wait | None = None
    requeue_seconds: float | None = None  # None: only the idle safety tick
    events: list[Event] = field(default_factory=list)
    clear_flags: set[str] = field(default_factory=set)
    progressed: bool = False
    terminate_analysis: bool = False
    new_attempt: bool = False


def weights_for(canary_bp: int, roles: set[str] | frozenset[str], has_baseline: bool) -> dict[str, int]:
    """The table's weights for a canary share. A baseline (stable revision,
    fresh workers) takes as much as the canary, so the two compare like for
    like, as far as what is left allows; the stable pool takes the rest."""
    out = {"canary": canary_bp}
    baseline = min(canary_bp, ALL_TRAFFIC_BP - canary_bp) if has_baseline and "baseline" in roles else 0
    if "baseline" in roles:
        out["baseline"] = baseline
    out["stable"] = ALL_TRAFFIC_BP - canary_bp - baseline
    return out


def evaluate(state: RolloutState, world: World, now: datetime) -> Decision:
    return _Tick(state, world, now).run()


class _Tick:
    def __init__(self, s: RolloutState, w: World, now: datetime):
        self.s, self.w, self.now = s, w, now
        self.d = Decision(
            phase=s.phase,
            step_index=s.step_index,
            step_started_at=s.step_started_at,
            pause_conditions=s.pause_conditions,
            message="",
            abort_reason=s.abort_reason,
        )
        self.roles = frozenset(w.weights)

    # ---- helpers -----------------------------------------------------------------
    def event(self, kind: str, message: str) -> None:
        self.d.events.append(Event(kind, message))

    def act(self, action: Action, message: str) -> Decision:
        if self.s.last_error and self.overdue() and self.d.phase != Phase.ABORTING:
            return self.start_abort(
                f"progress deadline of {self.s.progress_deadline_seconds:g} s exceeded: {self.s.last_error}"
            )
        self.d.action = action
        self.d.message = message
        self.d.progressed = True
        self.d.requeue_seconds = 0.0
        return self.d

    def wait(self, what: Wait, message: str, seconds: float | None) -> Decision:
        self.d.wait = what
        self.d.message = message
        self.d.requeue_seconds = seconds
        return self.d

    def set_phase(self, phase: Phase, kind: str, message: str) -> None:
        if phase != self.d.phase:
            self.d.phase = phase
            self.d.progressed = True
            self.event(kind, message)

    def overdue(self) -> bool:
        return (self.now - self.s.progress_at).total_seconds() > self.s.progress_deadline_seconds

    def wait_infra(self, what: Wait, message: str, seconds: float) -> Decision:
        """Wait for workers or gateways, within the progress deadline."""
        if self.overdue() and self.d.phase != Phase.ABORTING:
            return self.start_abort(
                f"progress deadline of {self.s.progress_deadline_seconds:g} s exceeded while {message}"
            )
        return self.wait(what, message, seconds)

    def weights(self, canary_bp: int) -> dict[str, int]:
        return weights_for(canary_bp, self.roles, self.s.has_baseline)

    def holds(self, desired: dict[str, int]) -> bool:
        return all(self.w.weights.get(role, 0) == bp for role, bp in desired.items())

    def ignore_flags(self, *names: str, why: str) -> None:
        for name in names:
            if getattr(self.s.flags, name):
                self.d.clear_flags.add(name)
                self.event("flag_ignored", f"{name.replace('_', '-')} ignored: {why}")

    # ---- stages ------------------------------------------------------------------
    def run(self) -> Decision:
        s = self.s
        # 1. Finished: only retry does anything.
        if s.phase.finished:
            if s.phase == Phase.ABORTED and s.flags.retry:
                self.d.clear_flags |= {"retry", "abort", "promote", "promote_full", "skip_step"}
                self.d.new_attempt = True
                self.d.step_index, self.d.step_started_at, self.d.pause_conditions = 0, self.now, ()
                self.d.abort_reason = ""
                self.set_phase(Phase.PROGRESSING, "retry", "retrying from the first step")
                self.d.requeue_seconds = 0.0
                return self.d
            self.ignore_flags(*s.flags.raised(), why=f"the rollout has {s.phase.label}")
            return self.d

        # 2. Abort first, in every phase.
        if s.flags.abort and s.phase != Phase.ABORTING:
            return self.start_abort(s.abort_reason or "abort requested")
        if s.phase == Phase.ABORTING:
            self.ignore_flags("promote", "promote_full", "skip_step", "retry", why="the rollout is aborting")
            return self._aborting()

        # 3. Promote-full skips what is left of the plan.
        if s.flags.promote_full and s.phase != Phase.PROMOTING:
            self.d.clear_flags.add("promote_full")
            return self.start_promotion("promote-full: skipping the remaining steps")
        if s.phase == Phase.PROMOTING:
            self.ignore_flags("promote", "promote_full", "skip_step", "retry", why="the rollout is promoting")
            return self._promoting()
        self.ignore_flags("retry", why="only an aborted rollout can be retried")

        if s.phase == Phase.PENDING:
            self.set_phase(Phase.PROGRESSING, "started", "rollout started")
        if s.fast_track:
            return self.start_promotion("fast-tracked rollback: no steps")

        # 4. Preparation: the canary runs the target, ready, gate passed.
        target = s.target_revision
        canary = self.w.canary
        if not canary.points_at(target):
            return self.act(Action(Act.SET_CANARY_REVISION, revision=target), "pointing the canary pool at the target")
        if not canary.ready_on(target):
            self.ignore_flags("promote", "skip_step", why="the canary is not ready yet")
            return self.wait_infra(
                Wait.CANARY, "waiting for the canary workers to run the target revision", WORKER_POLL_SECONDS
            )
        if s.gate == GateStatus.FAILED:
            return self.start_abort(f"consistency gate failed: {s.gate_message or 'outputs differ'}")
        if s.gate == GateStatus.PENDING:
            self.ignore_flags("promote", "skip_step", why="the consistency gate has not passed yet")
            return self.act(Action(Act.RUN_GATE), "replaying the consistency prompts on canary and stable")

        # 5. The current step.
        return self._step()

    def start_abort(self, reason: str) -> Decision:
        self.d.clear_flags |= {"promote", "promote_full", "skip_step"}
        self.d.abort_reason = reason
        self.d.pause_conditions = ()
        self.d.terminate_analysis = True
        self.set_phase(Phase.ABORTING, "aborting", reason)
        return self._aborting()

    def start_promotion(self, why: str) -> Decision:
        self.d.pause_conditions = ()
        self.d.terminate_analysis = True
        self.d.step_index = len(self.s.steps)
        self.set_phase(Phase.PROMOTING, "promoting", why)
        return self._promoting()

    def advance(self, kind: str, message: str) -> Decision:
        self.event(kind, message)
        self.d.step_index += 1
        self.d.step_started_at = self.now
        self.d.pause_conditions = ()
        self.d.progressed = True
        self.d.requeue_seconds = 0.0
        self.d.phase = Phase.PROGRESSING
        self.d.message = message
        return self.d

    def pause(self, reason: PauseReason, message: str) -> Decision:
        self.d.pause_conditions = (*self.d.pause_conditions, PauseCondition(reason, self.now))
        self.d.phase = Phase.PAUSED
        self.d.progressed = True
        self.event("paused", message)
        return self.wait(
            Wait.PERSON if reason == PauseReason.INCONCLUSIVE else Wait.PAUSE, message, self._pause_requeue()
        )

    def _pause_requeue(self) -> float | None:
        step = self._current()
        if isinstance(step, Pause) and step.duration_seconds is not None:
            return step.duration_seconds
        return None

    def _current(self) -> Step | None:
        return self.s.steps[self.d.step_index] if self.d.step_index < len(self.s.steps) else None

    def _step(self) -> Decision:
        s, w = self.s, self.w
        step = self._current()
        if step is None:
            return self.start_promotion(f"all {len(s.steps)} steps complete")
        where = f"step {self.d.step_index + 1}/{len(s.steps)} ({step.describe()})"
        if s.flags.skip_step:
            self.d.clear_flags.add("skip_step")
            self.d.terminate_analysis = isinstance(step, Analysis)
            return self.advance("step_skipped", f"{where} skipped by request")
        paused = bool(self.d.pause_conditions)
        if s.flags.promote:
            self.d.clear_flags.add("promote")
            self.d.terminate_analysis = isinstance(step, Analysis)
            return self.advance("promoted", f"{where} promoted" + (" from a pause" if paused else ""))

        if isinstance(step, SetWeight):
            desired = self.weights(step.weight_bp)
            if not self.holds(desired):
                return self.act(Action(Act.SET_WEIGHTS, weights=desired), f"{where}: setting weights")
            if not w.acked:
                return self.wait_infra(Wait.ACKS, f"{where}: waiting for every gateway to ack", ACK_POLL_SECONDS)
            return self.advance("step_completed", f"{where} done: every gateway routes by it")

        if isinstance(step, Pause):
            cond = next((c for c in self.d.pause_conditions if c.reason == PauseReason.PAUSE_STEP), None)
            if cond is None:
                return self.pause(PauseReason.PAUSE_STEP, f"{where}: paused")
            if step.duration_seconds is None:
                return self.wait(Wait.PAUSE, f"{where}: paused until promoted", None)
            ends = cond.since + timedelta(seconds=step.duration_seconds)
            if self.now >= ends:
                self.event("resumed", f"{where}: pause over")
                return self.advance("step_completed", f"{where} done")
            return self.wait(
                Wait.PAUSE,
                f"{where}: paused until {ends.isoformat(timespec='seconds')}",
                (ends - self.now).total_seconds(),
            )

        assert isinstance(step, Analysis)
        run = w.analysis
        if run is None:
            return self.act(Action(Act.START_ANALYSIS, template=step.template), f"{where}: starting")
        if run.phase == AnalysisPhase.SUCCESSFUL:
            return self.advance("step_completed", f"{where} passed: {run.message}")
        if run.phase in (AnalysisPhase.FAILED, AnalysisPhase.ERROR):
            return self.start_abort(f"{where} {run.phase.label}: {run.message}")
        if run.phase == AnalysisPhase.INCONCLUSIVE:
            if not any(c.reason == PauseReason.INCONCLUSIVE for c in self.d.pause_conditions):
                return self.pause(
                    PauseReason.INCONCLUSIVE, f"{where} inconclusive: {run.message}; promote to accept it, or abort"
                )
            return self.wait(Wait.PERSON, f"{where} inconclusive: waiting for promote or abort", None)
        due = run.next_measurement_at
        if due is None or self.now >= due:
            return self.act(Action(Act.MEASURE), f"{where}: measuring")
        return self.wait(Wait.MEASUREMENT, f"{where}: {run.message}", (due - self.now).total_seconds())

    def _promoting(self) -> Decision:
        """The stable pool moves to the target one worker at a time while the
        canary carries all the traffic, then the weights go back to the
        stable pool. A fast-tracked rollback has no canary to lean on: the
        stable pool keeps its traffic and each worker drains as it moves
        (the gateway retries a drained worker's refusals on the others)."""
        s, w = self.s, self.w
        target = s.target_revision
        move = pool_move(w.stable, target)
        if move.kind != MoveKind.DONE:
            carry = (
                self.weights(0)
                if s.fast_track
                else {role: (ALL_TRAFFIC_BP if role == "canary" else 0) for role in self.roles}
            )
            if not self.holds(carry):
                who = "the stable pool" if s.fast_track else "the canary"
                return self.act(Action(Act.SET_WEIGHTS, weights=carry), f"promoting: all traffic to {who}")
            if not w.acked:
                return self.wait_infra(Wait.ACKS, "promoting: waiting for every gateway to ack", ACK_POLL_SECONDS)
            return self._move_step(move, target, "promoting")
        back = self.weights(0)
        if not self.holds(back):
            return self.act(Action(Act.SET_WEIGHTS, weights=back), "promoting: all traffic back to the stable pool")
        if not w.acked:
            return self.wait_infra(Wait.ACKS, "promoting: waiting for every gateway to ack", ACK_POLL_SECONDS)
        if not w.canary.points_at(target):
            return self.act(Action(Act.SET_CANARY_REVISION, revision=target), "promoting: canary pool to the target")
        self.set_phase(Phase.SUCCEEDED, "succeeded", "the stable pool runs the target revision")
        self.d.message = "succeeded"
        self.d.requeue_seconds = None
        return self.d

    def _move_step(self, move: Move, revision: int, doing: str) -> Decision:
        if move.kind == MoveKind.MOVE:
            assert move.worker is not None
            return self.act(
                Action(Act.MOVE_WORKER, worker_id=move.worker.id, revision=revision),
                f"{doing}: moving worker {move.worker.name}",
            )
        if move.kind == MoveKind.WAIT and not (self.d.phase == Phase.ABORTING and self.overdue()):
            assert move.worker is not None
            return self.wait_infra(
                Wait.STABLE_WORKER,
                f"{doing}: waiting for worker {move.worker.name} to report ready",
                WORKER_POLL_SECONDS,
            )
        return self.act(Action(Act.FINALIZE_POOL, revision=revision), f"{doing}: pointing the stable pool at it")

    def _aborting(self) -> Decision:
        """Canary weight to 0 first, acked by every live gateway; then the
        canary workers return to the stable revision (the agent drains each
        before it switches); a stable pool caught mid-promotion goes back one
        worker at a time."""
        s, w = self.s, self.w
        overdue = self.overdue()
        off = self.weights(0)
        if not self.holds(off):
            return self.act(Action(Act.SET_WEIGHTS, weights=off, require_ready=False), "aborting: canary weight to 0")
        if not w.acked and not overdue:
            return self.wait(Wait.ACKS, "aborting: waiting for every gateway to ack canary weight 0", ACK_POLL_SECONDS)
        if not w.canary.points_at(s.stable_revision):
            return self.act(
                Action(Act.SET_CANARY_REVISION, revision=s.stable_revision),
                "aborting: canary workers back to the stable revision",
            )
        move = pool_move(w.stable, s.stable_revision)
        if move.kind != MoveKind.DONE:
            return self._move_step(move, s.stable_revision, "aborting: stable pool back")
        if not w.canary.all_live_on(s.stable_revision) and not overdue:
            return self.wait(
                Wait.CANARY_BACK,
                "aborting: waiting for the canary workers to run the stable revision",
                WORKER_POLL_SECONDS,
            )
        left = [] if w.acked else ["not every gateway acked"]
        if not w.canary.all_live_on(s.stable_revision):
            left.append("some canary workers do not yet run the stable revision")
        message = self.d.abort_reason or "aborted"
        if left:
            message += f" (progress deadline passed: {', '.join(left)})"
        self.d.clear_flags.add("abort")
        self.set_phase(Phase.ABORTED, "aborted", message)
        self.d.message = message
        self.d.requeue_seconds = None
        return self.d
