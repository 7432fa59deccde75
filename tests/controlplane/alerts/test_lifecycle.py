"""The alert state machine, as tables: at each tick the condition (True,
False, or None for no data) and the state expected after it. The clock is
the tick number times the interval; nothing here touches Django."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.alerts.lifecycle import (
    AlertState,
    NoData,
    Progress,
    Spec,
    compare,
    is_flapping,
    step,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)
INTERVAL = 15  # seconds between evaluations

# One letter per state keeps the tables readable.
I, P, F, R, N = AlertState.INACTIVE, AlertState.PENDING, AlertState.FIRING, AlertState.RESOLVED, AlertState.NODATA  # noqa: E741


def run(
    spec: Spec, conditions: list[bool | None]
) -> tuple[list[AlertState], list[tuple[int, AlertState, AlertState]], Progress]:
    """Feed one condition per tick; return the states, the transitions as
    (tick, from, to), and the final alert."""
    alert = Progress()
    states, transitions = [], []
    for tick, condition in enumerate(conditions):
        now = T0 + timedelta(seconds=tick * INTERVAL)
        value = None if condition is None else (1.0 if condition else 0.0)
        alert, transition = step(spec, alert, condition, value, now)
        states.append(alert.state)
        if transition is not None:
            assert transition.at == now
            transitions.append((tick, transition.from_state, transition.to_state))
    return states, transitions, alert


# ---- for --------------------------------------------------------------------------------

FOR_TABLE = [
    # (for seconds, conditions, expected states)
    pytest.param(0, [False, True, True, False], [I, F, F, R], id="for-0-fires-at-once"),
    pytest.param(30, [True, True, True, True], [P, P, F, F], id="fires-when-held-for-30s"),
    pytest.param(
        30, [True, True, False, True, True, True], [P, P, I, P, P, F], id="clearing-while-pending-restarts-the-clock"
    ),
    pytest.param(
        30, [True, True, True, False, False], [P, P, F, R, R], id="resolves-on-first-clear-without-keep-firing"
    ),
    pytest.param(
        30, [True, True, True, False, True], [P, P, F, R, P], id="refiring-after-resolve-goes-through-pending-again"
    ),
    pytest.param(45, [False, False, False], [I, I, I], id="never-true-stays-inactive"),
]


@pytest.mark.parametrize(("for_seconds", "conditions", "expected"), FOR_TABLE)
def test_for_holds_the_alert_pending_until_the_condition_has_lasted(
    for_seconds: float, conditions: list[bool], expected: list[AlertState]
) -> None:
    states, _, _ = run(Spec(for_seconds=for_seconds), conditions)
    assert states == expected


def test_fired_at_is_when_it_fired_and_active_at_when_the_condition_began() -> None:
    _, transitions, alert = run(Spec(for_seconds=30), [False, True, True, True])
    assert alert.active_at == T0 + timedelta(seconds=15)
    assert alert.fired_at == T0 + timedelta(seconds=45)
    assert transitions == [(1, I, P), (3, P, F)]


# ---- keep_firing_for ---------------------------------------------------------------------

KEEP_TABLE = [
    pytest.param(30, [True, False, False, False, False], [F, F, F, R, R], id="keeps-firing-30s-after-clearing"),
    pytest.param(
        30, [True, False, True, False, False, False], [F, F, F, F, F, R], id="condition-back-resets-the-keep-timer"
    ),
    pytest.param(60, [True, False, False, False, False, False], [F, F, F, F, F, R], id="keeps-firing-60s"),
]


@pytest.mark.parametrize(("keep_seconds", "conditions", "expected"), KEEP_TABLE)
def test_keep_firing_for_delays_resolution(
    keep_seconds: float, conditions: list[bool], expected: list[AlertState]
) -> None:
    states, _, _ = run(Spec(keep_firing_for_seconds=keep_seconds), conditions)
    assert states == expected


def test_keep_firing_since_marks_when_the_condition_cleared_and_clears_when_it_returns() -> None:
    spec = Spec(keep_firing_for_seconds=60)
    alert, _ = step(spec, Progress(), True, 5.0, T0)
    alert, _ = step(spec, alert, False, 0.5, T0 + timedelta(seconds=15))
    assert alert.state == F and alert.keep_firing_since == T0 + timedelta(seconds=15)
    alert, _ = step(spec, alert, True, 5.0, T0 + timedelta(seconds=30))
    assert alert.keep_firing_since is None


def test_a_pending_alert_is_not_kept_by_keep_firing_for() -> None:
    states, _, _ = run(Spec(for_seconds=60, keep_firing_for_seconds=60), [True, False])
    assert states == [P, I]


# ---- flapping -----------------------------------------------------------------------------


def test_an_alert_that_fires_three_times_within_the_window_is_flapping_and_holds_firing() -> None:
    spec = Spec(flap_window_seconds=600, flap_threshold=3)
    flips = [True, False, True, False, True, False, False, False]
    states, transitions, alert = run(spec, flips)
    # Fired, resolved, fired, resolved, fired: the third firing makes it flapping,
    # so the next clear does not resolve it.
    assert states == [F, R, F, R, F, F, F, F]
    assert [t for t in transitions if t[2] == R] == [(1, F, R), (3, F, R)]
    assert is_flapping(alert, spec, T0 + timedelta(seconds=7 * INTERVAL))


def test_a_flapping_alert_resolves_once_its_firings_age_out_of_the_window() -> None:
    spec = Spec(flap_window_seconds=120, flap_threshold=3)
    conditions = [True, False, True, False, True] + [False] * 12
    states, _, alert = run(spec, conditions)
    # Firings at ticks 0, 2, 4 (0 s, 30 s, 60 s); the window is 120 s, so
    # from 120 s on (tick 8) only two remain and the clear condition resolves it.
    assert states[4:8] == [F, F, F, F]
    assert states[8] == R
    assert not is_flapping(alert, spec, T0 + timedelta(seconds=16 * INTERVAL))


def test_keep_firing_for_damps_a_flapping_condition_without_any_resolve() -> None:
    states, transitions, _ = run(Spec(keep_firing_for_seconds=30), [True, False, True, False, True, False])
    assert states == [F] * 6
    assert transitions == [(0, I, F)]


# ---- no data -----------------------------------------------------------------------------

NODATA_TABLE = [
    pytest.param(NoData.NODATA, 0, [None, None], [N, N], id="nodata-is-its-own-state"),
    pytest.param(NoData.NODATA, 30, [None, None, None, None], [I, I, N, N], id="nodata-waits-for-for"),
    pytest.param(NoData.NODATA, 0, [True, None, False], [F, N, R], id="firing-then-nodata-then-clear-resolves"),
    pytest.param(NoData.NODATA, 0, [None, True], [N, F], id="data-returning-true-fires"),
    pytest.param(
        NoData.NODATA,
        30,
        [True, True, True, None, None, True],
        [P, P, F, F, F, F],
        id="short-gap-shorter-than-for-keeps-the-state",
    ),
    pytest.param(NoData.ALERTING, 0, [None, None, False], [F, F, R], id="alerting-counts-nodata-as-true"),
    pytest.param(NoData.OK, 0, [True, None, None], [F, R, R], id="ok-counts-nodata-as-false"),
    pytest.param(NoData.OK, 0, [None, None], [I, I], id="ok-with-no-data-stays-inactive"),
]


@pytest.mark.parametrize(("no_data", "for_seconds", "conditions", "expected"), NODATA_TABLE)
def test_no_data_is_never_silently_fine(
    no_data: NoData, for_seconds: float, conditions: list[bool | None], expected: list[AlertState]
) -> None:
    states, _, _ = run(Spec(for_seconds=for_seconds, no_data=no_data), conditions)
    assert states == expected


def test_a_nodata_transition_records_no_value_and_says_why() -> None:
    alert, transition = step(Spec(), Progress(), None, None, T0)
    assert transition is not None
    assert (transition.from_state, transition.to_state, transition.value) == (I, N, None)
    assert "no data" in transition.reason


def test_ok_for_no_data_still_says_no_data_in_the_reason() -> None:
    spec = Spec(no_data=NoData.OK)
    alert, _ = step(spec, Progress(), True, 3.0, T0)
    alert, transition = step(spec, alert, None, None, T0 + timedelta(seconds=15))
    assert transition is not None and transition.to_state == R
    assert "no data, counted as ok" in transition.reason


def test_a_non_finite_value_is_no_data() -> None:
    alert, transition = step(Spec(), Progress(), True, float("nan"), T0)
    assert alert.state == N


# ---- transitions carry values --------------------------------------------------------------


def test_every_transition_carries_the_value_that_caused_it() -> None:
    spec = Spec(for_seconds=15)
    alert = Progress()
    seen = []
    for tick, value in enumerate([0.1, 0.9, 0.95, 0.2]):
        alert, transition = step(spec, alert, compare(value, ">", 0.5), value, T0 + timedelta(seconds=15 * tick))
        if transition:
            seen.append((transition.to_state, transition.value))
    assert seen == [(P, 0.9), (F, 0.95), (R, 0.2)]


@pytest.mark.parametrize(
    ("value", "comparator", "threshold", "holds"),
    [
        (2.0, ">", 1.0, True),
        (1.0, ">", 1.0, False),
        (1.0, ">=", 1.0, True),
        (0.5, "<", 1.0, True),
        (1.0, "<=", 1.0, True),
        (1.0, "==", 1.0, True),
        (1.0, "!=", 1.0, False),
    ],
)
def test_comparators(value: float, comparator: str, threshold: float, holds: bool) -> None:
    assert compare(value, comparator, threshold) is holds


def test_states_are_ordered_so_active_is_one_comparison() -> None:
    assert [s for s in AlertState if s.is_active] == [N, P, F]
    assert [s for s in AlertState if s.is_notified] == [N, F]
