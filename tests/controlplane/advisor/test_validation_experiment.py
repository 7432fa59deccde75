"""The experiment's recommendation against a rerun
(``controlplane.advisor.validation.experiment``).

Fast: the rule "the rerun confirms it" on synthetic figures, each
recommendation made by the experiments' own rule from a synthetic sweep;
the arms of the sweep; an outcome read as an arm's figures.

Slow: one scenario on the reference engine, monolithic against one chunked
arm in two paired repeats, then the rerun; it checks the comparison ran on
real figures, never which arm wins.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from controlplane.advisor.validation import experiment as ex
from controlplane.advisor.validation import harness as h
from controlplane.advisor.validation.outcome import Objectives, Outcome
from controlplane.advisor.validation.scenarios import MONOLITHIC, select
from controlplane.experiments.recommend import ArmFigures, recommend
from controlplane.experiments.recommend import Objectives as RecObjectives
from controlplane.experiments.recommend import Outcome as RecOutcome

OBJ = RecObjectives(ttft_p99_seconds=2.0, tpot_p99_seconds=0.1, stall_p99_seconds=0.25)


def arm(name: str, goodput: list[float], *, throughput: list[float] | None = None, stall: float = 0.1) -> ArmFigures:
    return ArmFigures(
        name=name,
        goodput=goodput,
        throughput=throughput if throughput is not None else [500.0] * len(goodput),
        ttft_p99_seconds=[0.5] * len(goodput),
        tpot_p99_seconds=[0.05] * len(goodput),
        stall_p99_seconds=[stall] * len(goodput),
    )


def judge(sweep: list[ArmFigures], rerun: list[ArmFigures]) -> tuple[Any, ex.Confirmation]:
    recommendation = recommend(sweep, OBJ, baseline=MONOLITHIC)
    return recommendation, ex.confirms(recommendation, sweep, rerun, OBJ)


# ---- the rule --------------------------------------------------------------------------------

WINNER_SWEEP = [arm(MONOLITHIC, [1.0, 1.1, 1.05]), arm("chunk-128", [2.0, 2.1, 2.2])]
TIE_SWEEP = [arm(MONOLITHIC, [2.0, 2.1, 1.9]), arm("chunk-128", [2.02, 2.05, 1.95])]


@pytest.mark.parametrize(
    ("sweep", "rerun", "outcome", "confirmed"),
    [
        # a winner the rerun confirms: it beats the baseline again
        (WINNER_SWEEP, [arm("chunk-128", [1.9, 2.0]), arm(MONOLITHIC, [1.0, 1.0])], RecOutcome.WINNER, True),
        # a winner the rerun reverses
        (WINNER_SWEEP, [arm("chunk-128", [1.0, 1.1]), arm(MONOLITHIC, [1.5, 1.6])], RecOutcome.WINNER, False),
        # ... or only equals: the direction does not hold
        (WINNER_SWEEP, [arm("chunk-128", [1.2, 1.2]), arm(MONOLITHIC, [1.2, 1.2])], RecOutcome.WINNER, False),
        # a winner that breaks an objective in the rerun, whatever its goodput
        (
            WINNER_SWEEP,
            [arm("chunk-128", [2.0, 2.1], stall=0.4), arm(MONOLITHIC, [1.0, 1.0])],
            RecOutcome.WINNER,
            False,
        ),
        # a tie the rerun confirms: the difference stays small
        (
            TIE_SWEEP,
            [arm(MONOLITHIC, [2.0, 2.05]), arm("chunk-128", [2.03, 2.0])],
            RecOutcome.NO_SIGNIFICANT_WINNER,
            True,
        ),
        # a tie the rerun breaks: one arm is now 50% ahead
        (
            TIE_SWEEP,
            [arm(MONOLITHIC, [2.0, 2.0]), arm("chunk-128", [3.0, 3.1])],
            RecOutcome.NO_SIGNIFICANT_WINNER,
            False,
        ),
    ],
    ids=["winner-confirmed", "winner-reversed", "winner-equal", "winner-breaks", "tie-confirmed", "tie-broken"],
)
def test_the_rerun_confirms_or_not(
    sweep: list[ArmFigures], rerun: list[ArmFigures], outcome: RecOutcome, confirmed: bool
) -> None:
    recommendation, c = judge(sweep, rerun)
    assert recommendation.outcome == outcome, recommendation.reasons
    assert c.confirmed is confirmed, c.reason
    assert c.reason


def test_a_winner_because_the_baseline_broke_the_stall_objective_is_confirmed_when_it_breaks_it_again() -> None:
    sweep = [arm(MONOLITHIC, [2.0, 2.1], stall=0.6), arm("chunk-128", [1.9, 2.0])]
    rerun_broke = [arm("chunk-128", [1.9, 1.9]), arm(MONOLITHIC, [2.0, 2.0], stall=0.7)]
    recommendation, c = judge(sweep, rerun_broke)
    assert (recommendation.winner, recommendation.outcome) == ("chunk-128", RecOutcome.WINNER)
    assert c.confirmed is True and "again broke" in c.reason
    # the baseline meets it in the rerun and has the better goodput: not confirmed
    _, c = judge(sweep, [arm("chunk-128", [1.9, 1.9]), arm(MONOLITHIC, [2.0, 2.0])])
    assert c.confirmed is False, c.reason


def test_a_confirmed_tie_names_an_arm_that_broke_an_objective_in_the_rerun() -> None:
    _, c = judge(TIE_SWEEP, [arm(MONOLITHIC, [2.0, 2.05], stall=0.3), arm("chunk-128", [2.03, 2.0])])
    assert c.confirmed is True
    assert "monolithic broke an objective: stall P99 300 ms" in c.reason


def test_keeping_the_baseline_is_rerun_against_the_runner_up() -> None:
    sweep = [arm(MONOLITHIC, [3.0, 3.1]), arm("chunk-128", [1.0, 1.1]), arm("chunk-512", [2.0, 2.1])]
    recommendation = recommend(sweep, OBJ, baseline=MONOLITHIC)
    assert recommendation.winner == MONOLITHIC
    assert ex.rerun_pair(recommendation, sweep) == (MONOLITHIC, "chunk-512")


def test_a_tie_is_rerun_on_the_baseline_and_the_best_other_tied_arm() -> None:
    recommendation = recommend(TIE_SWEEP, OBJ, baseline=MONOLITHIC)
    assert ex.rerun_pair(recommendation, TIE_SWEEP) == (MONOLITHIC, "chunk-128")


def test_one_repeat_names_nothing_to_confirm() -> None:
    sweep = [arm(MONOLITHIC, [1.0]), arm("chunk-128", [2.0])]
    recommendation, c = judge(sweep, [])
    assert recommendation.outcome == RecOutcome.NEEDS_REPEATS
    assert ex.rerun_pair(recommendation, sweep) is None
    assert c.confirmed is None and "nothing to confirm" in c.reason


def test_the_sweeps_arms_are_monolithic_and_chunked_with_a_budget_of_at_least_256() -> None:
    arms = ex.arms(2048, (128, 512))
    assert arms[MONOLITHIC]["prefill_mode"] == "monolithic"
    assert arms["chunk-128"]["long_prefill_token_threshold"] == 128
    assert arms["chunk-128"]["max_num_batched_tokens"] == 256
    assert arms["chunk-512"]["max_num_batched_tokens"] == 512
    assert {a["max_num_seqs"] for a in arms.values()} == {32}


def test_outcomes_become_an_arms_figures_repeat_by_repeat() -> None:
    def outcome(goodput: float, stall: float | None, ok: int = 10) -> Outcome:
        return Outcome(10, ok, 20.0, stall, 0.02, 0.03, 0.1, 0.4, 300.0 + goodput, goodput, 0.0)

    f = ex.figures("chunk-128", [outcome(1.0, 0.2), outcome(1.5, None)])
    assert list(f.goodput) == [1.0, 1.5]
    assert list(f.throughput) == [301.0, 301.5]
    assert list(f.stall_p99_seconds) == [0.2]  # a repeat without a gap measured adds none
    assert not f.failed
    assert ex.figures("x", [outcome(0.0, None, ok=0)]).failed


def test_the_commands_table_shows_the_recommendation_the_rerun_and_whether_it_held() -> None:
    from controlplane.advisor.management.commands.validate_decisions import experiment_table

    def outcome(goodput: float) -> Outcome:
        return Outcome(36, 36, 20.0, 0.08, 0.02, 0.03, 0.1, 0.4, 120.0, goodput, 0.0)

    rerun = [arm("chunk-128", [1.9, 2.0]), arm(MONOLITHIC, [1.0, 1.0])]
    recommendation, c = judge(WINNER_SWEEP, rerun)
    row = ex.ExperimentRow(
        select(["long-tail"])[0],
        recommendation,
        {},
        {"chunk-128": [outcome(1.9), outcome(2.0)], MONOLITHIC: [outcome(1.0), outcome(1.0)]},
        c,
    )
    line = experiment_table([row]).splitlines()[-1]
    assert line.startswith("| long-tail | winner: chunk-128 | chunk-128 has the highest goodput")
    assert "chunk-128: goodput 1.90, 2.00 req/s, stall P99 80, 80 ms, 120, 120 tok/s (36, 36 requests)" in line
    assert line.endswith(f"| yes: {c.reason} |")


# ---- one real sweep and rerun -------------------------------------------------------------------


@pytest.mark.slow
def test_a_sweep_and_its_rerun_on_reference_workers(tmp_path: Path) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    harness = h.Harness(
        h.LaunchedWorkers(h.TINY_MODEL, tmp_path, 2048, nice=-10),
        Objectives(ttft_seconds=2.0, tbt_seconds=0.6, tpot_seconds=0.1),
        2048,
        model_dir=h.TINY_MODEL,
        duration_scale=0.35,  # long-tail's 50 s arms to ~18 s
    )
    row = ex.Experiment(harness, ex.arms(2048, (128,)), repeats=2, rerun_repeats=2).run(select(["long-tail"])[0])
    out = tmp_path / "verdict.json"
    out.write_text(json.dumps(row.to_json(), default=str))
    print(row.recommendation.reasons, row.confirmation)  # shown with -s

    # the sweep: both arms, two paired repeats each, the same requests in repeat r
    assert set(row.sweep) == {MONOLITHIC, "chunk-128"}
    for r in range(2):
        counts = {runs[r].num_requests for runs in row.sweep.values()}
        assert len(counts) == 1 and counts.pop() > 0
    assert all(o.num_ok > 0 for runs in row.sweep.values() for o in runs)
    # a recommendation from those figures
    assert row.recommendation.outcome != RecOutcome.NEEDS_REPEATS
    assert row.recommendation.versus_baseline["chunk-128"].num_pairs == 2
    assert row.recommendation.reasons
    # the rerun: the pair on fresh repeats, the same requests for both arms
    pair = ex.rerun_pair(row.recommendation, [ex.figures(n, runs) for n, runs in row.sweep.items()])
    if pair is None:
        assert row.confirmation.confirmed is None and not row.rerun
    else:
        assert set(row.rerun) == set(pair)
        for r in range(2):
            counts = {runs[r].num_requests for runs in row.rerun.values()}
            assert len(counts) == 1 and counts.pop() > 0
        assert isinstance(row.confirmation.confirmed, bool)
    assert row.confirmation.reason
    written = json.loads(out.read_text())
    assert written["confirmed"] == row.confirmation.confirmed
    assert written["recommendation"]["outcome"] == row.recommendation.outcome.value
