"""The step evaluator as tables: stored state + world + flags → next action.
Pure; the clock is time-machine's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime

import pytest
import time_machine

from controlplane.rollouts.evaluator import (
    Act,
    Action,
    AnalysisView,
    Flags,
    GateStatus,
    MoveKind,
    PauseCondition,
    PauseReason,
    Phase,
    PoolView,
    RolloutState,
    Wait,
    WorkerView,
    World,
    evaluate,
    pool_move,
    weights_for,
)
from controlplane.rollouts.judge import AnalysisPhase
from controlplane.rollouts.steps import Analysis, Pause, SetWeight, default_plan

STABLE, TARGET = 1, 2
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PLAN = (SetWeight(1000), Analysis("default"), Pause(60), SetWeight(5000), Pause(None), SetWeight(10000))


@pytest.fixture
def clock() -> Iterator[time_machine.Coordinates]:
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


def now() -> datetime:
    return datetime.now(UTC)


def worker(
    wid: int, running: int | None, *, override: int | None = None, ready: bool = True, live: bool = True
) -> WorkerView:
    return WorkerView(wid, f"w{wid}", override, running, ready, live)


def pool(desired: int | None, *workers: WorkerView) -> PoolView:
    return PoolView(desired, tuple(workers))


CANARY_READY = pool(TARGET, worker(10, TARGET), worker(11, TARGET))
STABLE_POOL = pool(STABLE, worker(1, STABLE), worker(2, STABLE), worker(3, STABLE))


def state(**kw: object) -> RolloutState:
    base = RolloutState(
        phase=Phase.PROGRESSING,
        steps=PLAN,
        step_index=0,
        step_started_at=T0,
        pause_conditions=(),
        flags=Flags(),
        stable_revision=STABLE,
        target_revision=TARGET,
        gate=GateStatus.PASSED,
        progress_at=T0,
        progress_deadline_seconds=300,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def world(**kw: object) -> World:
    base = World(weights={"canary": 0, "stable": 10000}, acked=True, canary=CANARY_READY, stable=STABLE_POOL)
    return replace(base, **kw)  # type: ignore[arg-type]


# ---- preparation: the canary runs the target before it takes traffic ----------------------


@pytest.mark.parametrize(
    ("s", "w", "action", "wait", "phase"),
    [
        # a new rollout points the canary pool at the target first
        (
            state(phase=Phase.PENDING, gate=GateStatus.PENDING),
            world(canary=pool(STABLE, worker(10, STABLE))),
            Action(Act.SET_CANARY_REVISION, revision=TARGET),
            None,
            Phase.PROGRESSING,
        ),
        # a per-worker override in the canary pool is cleared the same way
        (
            state(),
            world(canary=pool(TARGET, worker(10, STABLE, override=STABLE))),
            Action(Act.SET_CANARY_REVISION, revision=TARGET),
            None,
            Phase.PROGRESSING,
        ),
        # then waits until every live canary worker reports ready on it
        (
            state(),
            world(canary=pool(TARGET, worker(10, TARGET), worker(11, STABLE, ready=False))),
            None,
            Wait.CANARY,
            Phase.PROGRESSING,
        ),
        # a lost worker is not waited for
        (
            state(),
            world(canary=pool(TARGET, worker(10, TARGET), worker(11, STABLE, live=False))),
            Action(Act.SET_WEIGHTS, weights={"canary": 1000, "stable": 9000}),
            None,
            Phase.PROGRESSING,
        ),
        # no live canary worker at all: nothing can take the traffic
        (state(), world(canary=pool(TARGET, worker(10, TARGET, live=False))), None, Wait.CANARY, Phase.PROGRESSING),
        # a chunked target replays the gate before any traffic
        (state(gate=GateStatus.PENDING), world(), Action(Act.RUN_GATE), None, Phase.PROGRESSING),
        (
            state(gate=GateStatus.SKIPPED),
            world(),
            Action(Act.SET_WEIGHTS, weights={"canary": 1000, "stable": 9000}),
            None,
            Phase.PROGRESSING,
        ),
    ],
)
def test_the_canary_is_ready_and_gated_before_it_takes_traffic(clock, s, w, action, wait, phase) -> None:
    d = evaluate(s, w, now())
    assert (d.action, d.wait, d.phase) == (action, wait, phase)


def test_a_failed_gate_aborts_showing_where_outputs_differ(clock) -> None:
    s = state(gate=GateStatus.FAILED, gate_message="prompt #2 (160 tokens) differs at output position 3")
    d = evaluate(s, world(), now())
    assert d.phase == Phase.ABORTING
    assert "differs at output position 3" in d.abort_reason


def test_waiting_for_the_canary_past_the_deadline_aborts(clock) -> None:
    s = state()
    w = world(canary=pool(TARGET, worker(10, STABLE, ready=False)))
    assert evaluate(s, w, now()).wait == Wait.CANARY
    clock.shift(301)
    d = evaluate(s, w, now())
    assert d.phase == Phase.ABORTING and "progress deadline of 300 s exceeded" in d.abort_reason
    # the canary weight is already 0 and acked: straight to the canary's way back
    assert d.action == Action(Act.SET_CANARY_REVISION, revision=STABLE)


def test_an_action_failing_past_the_deadline_aborts(clock) -> None:
    s = state(last_error="pool `c` has no ready worker")
    assert evaluate(s, world(), now()).action.kind == Act.SET_WEIGHTS  # retried while in time
    clock.shift(301)
    d = evaluate(s, world(), now())
    assert d.phase == Phase.ABORTING and "no ready worker" in d.abort_reason


# ---- set_weight ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("canary_bp", "roles", "has_baseline", "expected"),
    [
        (1000, {"canary", "stable"}, False, {"canary": 1000, "stable": 9000}),
        (1000, {"canary", "baseline", "stable"}, True, {"canary": 1000, "baseline": 1000, "stable": 8000}),
        (5000, {"canary", "baseline", "stable"}, True, {"canary": 5000, "baseline": 5000, "stable": 0}),
        (7500, {"canary", "baseline", "stable"}, True, {"canary": 7500, "baseline": 2500, "stable": 0}),
        (10000, {"canary", "baseline", "stable"}, True, {"canary": 10000, "baseline": 0, "stable": 0}),
        # a baseline pool in the table that the rollout does not use stays at 0
        (2500, {"canary", "baseline", "stable"}, False, {"canary": 2500, "baseline": 0, "stable": 7500}),
    ],
)
def test_weights_give_the_baseline_as_much_as_the_canary(canary_bp, roles, has_baseline, expected) -> None:
    assert weights_for(canary_bp, roles, has_baseline) == expected


@pytest.mark.parametrize(
    ("w", "action", "wait", "step_index"),
    [
        (world(), Action(Act.SET_WEIGHTS, weights={"canary": 1000, "stable": 9000}), None, 0),
        # held but not acked by every gateway: not done
        (world(weights={"canary": 1000, "stable": 9000}, acked=False), None, Wait.ACKS, 0),
        # held and acked: the step is complete
        (world(weights={"canary": 1000, "stable": 9000}, acked=True), None, None, 1),
    ],
)
def test_a_set_weight_step_completes_only_when_every_gateway_acked(clock, w, action, wait, step_index) -> None:
    d = evaluate(state(), w, now())
    assert (d.action, d.wait, d.step_index) == (action, wait, step_index)


def test_acks_that_never_come_abort_at_the_deadline(clock) -> None:
    w = world(weights={"canary": 1000, "stable": 9000}, acked=False)
    clock.shift(301)
    d = evaluate(state(), w, now())
    assert d.phase == Phase.ABORTING
    assert d.action == Action(Act.SET_WEIGHTS, weights={"canary": 0, "stable": 10000}, require_ready=False)


# ---- pause ---------------------------------------------------------------------------------


def test_a_timed_pause_pauses_then_resumes_by_itself(clock) -> None:
    s = state(step_index=2)
    d = evaluate(s, world(), now())
    assert d.phase == Phase.PAUSED and d.requeue_seconds == 60
    assert d.pause_conditions == (PauseCondition(PauseReason.PAUSE_STEP, T0),)
    s = replace(s, phase=d.phase, pause_conditions=d.pause_conditions)
    clock.shift(30)
    d = evaluate(s, world(), now())
    assert d.wait == Wait.PAUSE and d.requeue_seconds == 30 and d.step_index == 2
    clock.shift(30)
    d = evaluate(s, world(), now())
    assert (d.phase, d.step_index, d.pause_conditions) == (Phase.PROGRESSING, 3, ())


def test_an_indefinite_pause_waits_for_promote_and_never_hits_the_deadline(clock) -> None:
    cond = (PauseCondition(PauseReason.PAUSE_STEP, T0),)
    s = state(phase=Phase.PAUSED, step_index=4, pause_conditions=cond)
    clock.shift(3600)
    d = evaluate(s, world(), now())
    assert d.phase == Phase.PAUSED and d.wait == Wait.PAUSE and d.requeue_seconds is None
    d = evaluate(replace(s, flags=Flags(promote=True)), world(), now())
    assert (d.phase, d.step_index, d.clear_flags) == (Phase.PROGRESSING, 5, {"promote"})


# ---- analysis ------------------------------------------------------------------------------


def run(phase: AnalysisPhase, due: datetime | None = None, message: str = "") -> AnalysisView:
    return AnalysisView(phase, message, due)


@pytest.mark.parametrize(
    ("analysis", "action", "wait", "phase", "step_index"),
    [
        (None, Action(Act.START_ANALYSIS, template="default"), None, Phase.PROGRESSING, 1),
        (run(AnalysisPhase.PENDING, T0), Action(Act.MEASURE), None, Phase.PROGRESSING, 1),
        (
            run(AnalysisPhase.RUNNING, datetime(2026, 3, 1, 12, 0, 20, tzinfo=UTC)),
            None,
            Wait.MEASUREMENT,
            Phase.PROGRESSING,
            1,
        ),
        (run(AnalysisPhase.SUCCESSFUL), None, None, Phase.PROGRESSING, 2),
        (
            run(AnalysisPhase.FAILED, message="ttft: 1 failed"),
            Action(Act.SET_WEIGHTS, weights={"canary": 0, "stable": 10000}, require_ready=False),
            None,
            Phase.ABORTING,
            1,
        ),
        (
            run(AnalysisPhase.ERROR),
            Action(Act.SET_WEIGHTS, weights={"canary": 0, "stable": 10000}, require_ready=False),
            None,
            Phase.ABORTING,
            1,
        ),
        # inconclusive pauses for a person, it never aborts
        (run(AnalysisPhase.INCONCLUSIVE), None, Wait.PERSON, Phase.PAUSED, 1),
    ],
)
def test_analysis_steps_follow_the_run(clock, analysis, action, wait, phase, step_index) -> None:
    s = state(step_index=1)
    w = world(weights={"canary": 1000, "stable": 9000}, analysis=analysis)
    d = evaluate(s, w, now())
    assert (d.action, d.wait, d.phase, d.step_index) == (action, wait, phase, step_index)


def test_a_measurement_wait_says_when(clock) -> None:
    due = datetime(2026, 3, 1, 12, 0, 20, tzinfo=UTC)
    d = evaluate(state(step_index=1), world(analysis=run(AnalysisPhase.RUNNING, due)), now())
    assert d.requeue_seconds == 20


def test_a_failed_analysis_aborts_with_its_reason(clock) -> None:
    d = evaluate(state(step_index=1), world(analysis=run(AnalysisPhase.FAILED, message="ttft: 1 failed > 0")), now())
    assert "failed: ttft: 1 failed > 0" in d.abort_reason and d.terminate_analysis


def test_promote_accepts_an_inconclusive_analysis(clock) -> None:
    cond = (PauseCondition(PauseReason.INCONCLUSIVE, T0),)
    s = state(phase=Phase.PAUSED, step_index=1, pause_conditions=cond, flags=Flags(promote=True))
    d = evaluate(s, world(analysis=run(AnalysisPhase.INCONCLUSIVE)), now())
    assert (d.phase, d.step_index, d.pause_conditions) == (Phase.PROGRESSING, 2, ())


def test_skip_step_abandons_a_running_analysis(clock) -> None:
    s = state(step_index=1, flags=Flags(skip_step=True))
    d = evaluate(s, world(analysis=run(AnalysisPhase.RUNNING, T0)), now())
    assert d.step_index == 2 and d.terminate_analysis and d.clear_flags == {"skip_step"}
    assert [e.kind for e in d.events] == ["step_skipped"]


# ---- abort ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s",
    [
        state(phase=Phase.PENDING, flags=Flags(abort=True)),
        state(step_index=0, flags=Flags(abort=True, promote=True)),
        state(
            phase=Phase.PAUSED,
            step_index=4,
            flags=Flags(abort=True),
            pause_conditions=(PauseCondition(PauseReason.PAUSE_STEP, T0),),
        ),
        state(phase=Phase.PROMOTING, step_index=6, flags=Flags(abort=True)),
    ],
)
def test_abort_sets_canary_weight_to_zero_first(clock, s) -> None:
    w = world(weights={"canary": 2500, "stable": 7500}, acked=False)
    d = evaluate(s, w, now())
    assert d.phase == Phase.ABORTING
    assert d.action == Action(Act.SET_WEIGHTS, weights={"canary": 0, "stable": 10000}, require_ready=False)
    assert {"promote", "promote_full", "skip_step"} <= d.clear_flags  # a pending promote dies with the abort
    assert d.pause_conditions == ()


def test_abort_wins_over_a_weight_step_still_waiting_for_acks(clock) -> None:
    s = state(step_index=0, flags=Flags(abort=True))
    d = evaluate(s, world(weights={"canary": 1000, "stable": 9000}, acked=False), now())
    assert d.phase == Phase.ABORTING and d.action.weights == {"canary": 0, "stable": 10000}


@pytest.mark.parametrize(
    ("w", "action", "wait", "phase"),
    [
        # the canary's weight 0 must be acked by every gateway before anything else
        (world(acked=False, canary=CANARY_READY), None, Wait.ACKS, Phase.ABORTING),
        # then the canary pool goes back to the stable revision
        (world(canary=CANARY_READY), Action(Act.SET_CANARY_REVISION, revision=STABLE), None, Phase.ABORTING),
        # and the abort waits for the canary workers to drain and switch
        (
            world(canary=pool(STABLE, worker(10, TARGET, ready=False), worker(11, STABLE))),
            None,
            Wait.CANARY_BACK,
            Phase.ABORTING,
        ),
        (world(canary=pool(STABLE, worker(10, STABLE), worker(11, STABLE))), None, None, Phase.ABORTED),
        # a stable pool caught mid-promotion goes back one worker at a time
        (
            world(
                canary=pool(STABLE, worker(10, STABLE)),
                stable=pool(STABLE, worker(1, TARGET, override=TARGET), worker(2, STABLE)),
            ),
            Action(Act.MOVE_WORKER, worker_id=1, revision=STABLE),
            None,
            Phase.ABORTING,
        ),
    ],
)
def test_an_abort_returns_the_canary_after_the_gateways_ack(clock, w, action, wait, phase) -> None:
    s = state(phase=Phase.ABORTING, abort_reason="abort requested by alice")
    d = evaluate(s, w, now())
    assert (d.action, d.wait, d.phase) == (action, wait, phase)


def test_an_abort_past_its_deadline_finishes_and_says_what_was_left(clock) -> None:
    s = state(phase=Phase.ABORTING, abort_reason="abort requested by alice")
    w = world(acked=False, canary=pool(STABLE, worker(10, TARGET, ready=False)))
    clock.shift(301)
    d = evaluate(s, w, now())
    assert d.phase == Phase.ABORTED
    assert "not every gateway acked" in d.message and "canary workers" in d.message


def test_an_aborted_rollout_retries_from_the_first_step(clock) -> None:
    s = state(phase=Phase.ABORTED, step_index=3, flags=Flags(retry=True), abort_reason="x")
    d = evaluate(s, world(), now())
    assert (d.phase, d.step_index, d.new_attempt, d.abort_reason) == (Phase.PROGRESSING, 0, True, "")
    assert "retry" in d.clear_flags


def test_flags_on_a_finished_rollout_are_cleared_and_ignored(clock) -> None:
    d = evaluate(state(phase=Phase.SUCCEEDED, flags=Flags(abort=True)), world(), now())
    assert d.phase == Phase.SUCCEEDED and d.clear_flags == {"abort"} and d.action is None
    assert d.events[0].kind == "flag_ignored"


# ---- promotion -----------------------------------------------------------------------------


CARRY = {"canary": 10000, "stable": 0}


@pytest.mark.parametrize(
    ("w", "action", "wait", "phase"),
    [
        # all traffic to the canary first, acked
        (
            world(weights={"canary": 5000, "stable": 5000}),
            Action(Act.SET_WEIGHTS, weights=CARRY),
            None,
            Phase.PROMOTING,
        ),
        (world(weights=CARRY, acked=False), None, Wait.ACKS, Phase.PROMOTING),
        # then the stable pool moves one worker at a time, by name
        (world(weights=CARRY), Action(Act.MOVE_WORKER, worker_id=1, revision=TARGET), None, Phase.PROMOTING),
        (
            world(
                weights=CARRY, stable=pool(STABLE, worker(1, STABLE, override=TARGET, ready=False), worker(2, STABLE))
            ),
            None,
            Wait.STABLE_WORKER,
            Phase.PROMOTING,
        ),
        (
            world(weights=CARRY, stable=pool(STABLE, worker(1, TARGET, override=TARGET), worker(2, STABLE))),
            Action(Act.MOVE_WORKER, worker_id=2, revision=TARGET),
            None,
            Phase.PROMOTING,
        ),
        (
            world(
                weights=CARRY,
                stable=pool(STABLE, worker(1, TARGET, override=TARGET), worker(2, TARGET, override=TARGET)),
            ),
            Action(Act.FINALIZE_POOL, revision=TARGET),
            None,
            Phase.PROMOTING,
        ),
        # then the weights return to the stable pool
        (
            world(weights=CARRY, stable=pool(TARGET, worker(1, TARGET), worker(2, TARGET))),
            Action(Act.SET_WEIGHTS, weights={"canary": 0, "stable": 10000}),
            None,
            Phase.PROMOTING,
        ),
        (
            world(acked=False, stable=pool(TARGET, worker(1, TARGET), worker(2, TARGET))),
            None,
            Wait.ACKS,
            Phase.PROMOTING,
        ),
        (world(stable=pool(TARGET, worker(1, TARGET), worker(2, TARGET))), None, None, Phase.SUCCEEDED),
    ],
)
def test_promotion_moves_the_stable_pool_while_the_canary_carries_the_traffic(clock, w, action, wait, phase) -> None:
    s = state(phase=Phase.PROMOTING, step_index=len(PLAN))
    d = evaluate(s, w, now())
    assert (d.action, d.wait, d.phase) == (action, wait, phase)


def test_promote_full_skips_the_remaining_steps(clock) -> None:
    s = state(step_index=1, flags=Flags(promote_full=True))
    d = evaluate(s, world(weights={"canary": 1000, "stable": 9000}, analysis=run(AnalysisPhase.RUNNING, T0)), now())
    assert (d.phase, d.step_index) == (Phase.PROMOTING, len(PLAN))
    assert d.terminate_analysis and d.action == Action(Act.SET_WEIGHTS, weights=CARRY)


def test_the_last_step_leads_to_promotion(clock) -> None:
    s = state(step_index=len(PLAN) - 1)
    d = evaluate(s, world(weights=CARRY), now())
    assert d.step_index == len(PLAN)
    d = evaluate(replace(s, step_index=d.step_index), world(weights=CARRY), now())
    assert d.phase == Phase.PROMOTING and d.action == Action(Act.MOVE_WORKER, worker_id=1, revision=TARGET)


def test_a_fast_tracked_rollback_moves_the_stable_pool_under_its_own_traffic(clock) -> None:
    s = state(phase=Phase.PENDING, steps=(), fast_track=True, gate=GateStatus.SKIPPED)
    d = evaluate(s, world(canary=pool(STABLE, worker(10, STABLE))), now())
    assert d.phase == Phase.PROMOTING
    assert d.action == Action(Act.MOVE_WORKER, worker_id=1, revision=TARGET)
    # at the end the canary pool follows, while it carries nothing
    done = world(canary=pool(STABLE, worker(10, STABLE)), stable=pool(TARGET, worker(1, TARGET)))
    d = evaluate(replace(s, phase=Phase.PROMOTING), done, now())
    assert d.action == Action(Act.SET_CANARY_REVISION, revision=TARGET)


@pytest.mark.parametrize(
    ("p", "kind", "worker_id"),
    [
        (pool(STABLE, worker(2, STABLE), worker(1, STABLE)), MoveKind.MOVE, 1),
        (pool(STABLE, worker(1, TARGET, override=TARGET), worker(2, STABLE)), MoveKind.MOVE, 2),
        (pool(STABLE, worker(1, STABLE, override=TARGET), worker(2, STABLE)), MoveKind.WAIT, 1),
        (pool(STABLE, worker(1, TARGET, override=TARGET), worker(2, STABLE, live=False)), MoveKind.FINALIZE, None),
        (pool(TARGET, worker(1, TARGET), worker(2, STABLE, ready=False)), MoveKind.WAIT, 2),
        (pool(TARGET, worker(1, TARGET)), MoveKind.DONE, None),
        (pool(TARGET), MoveKind.DONE, None),
    ],
)
def test_pool_moves_go_one_worker_at_a_time(p, kind, worker_id) -> None:
    move = pool_move(p, TARGET)
    assert move.kind == kind
    assert (move.worker.id if move.worker else None) == worker_id


def test_the_default_plan_is_ten_twenty_five_fifty_hundred_with_analysis_between() -> None:
    assert default_plan() == [
        SetWeight(1000),
        Analysis("default"),
        SetWeight(2500),
        Analysis("default"),
        SetWeight(5000),
        Analysis("default"),
        SetWeight(10000),
    ]
