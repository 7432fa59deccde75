"""The recommendation, as a table. Arms are compared pair by pair (repeat r
of every arm replays the same requests): a clear winner; a tie built to be
a tie (paired differences of both signs) said as "no significant winner";
noisy repeats whose pairs all agree (a winner the spread over repeats alone
would have hidden); a consistent difference too small to act on; throughput breaking a goodput tie; one repeat never
naming a winner ("0.304 ± 0 vs 0.303"); objectives, failures and arms not
comparable set aside; capacity deciding when measured in every repeat."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from controlplane.experiments.recommend import (
    ArmFigures,
    Objectives,
    Outcome,
    paired_difference,
    recommend,
)

SLO = Objectives(ttft_p99_seconds=1.0, tpot_p99_seconds=0.1)


def arm(
    name: str,
    goodput: tuple[float, ...],
    throughput: tuple[float, ...] | None = None,
    ttft: float = 0.5,
    tpot: float = 0.05,
    capacity: tuple[float, ...] = (),
    failed: str = "",
    not_comparable: str = "",
) -> ArmFigures:
    n = len(goodput)
    return ArmFigures(
        name,
        goodput,
        throughput if throughput is not None else (100.0,) * n,
        (ttft,) * n,
        (tpot,) * n,
        (0.2,) * n,
        capacity,
        failed,
        not_comparable,
    )


@dataclass(frozen=True)
class Case:
    name: str
    arms: tuple[ArmFigures, ...]
    winner: str | None
    outcome: Outcome = Outcome.WINNER
    broke: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    basis: str = "goodput"
    says: str = ""


CASES = [
    Case(
        "clear winner over three paired repeats",
        (
            arm("baseline", (1.0, 1.1, 1.05)),
            arm("chunk-512", (2.0, 2.1, 2.02)),
            arm("chunk-1024", (1.5, 1.6, 1.55)),
        ),
        "chunk-512",
        says="highest goodput",
    ),
    Case(
        "one repeat: 0.304 ± 0 against 0.303 names no winner and says what it needs",
        (arm("baseline", (0.303,)), arm("chunk-512", (0.304,))),
        None,
        Outcome.NEEDS_REPEATS,
        says="needs at least 2 paired repeats (3 recommended). Measured best: chunk-512 at 0.304 ± 0 req/s; "
        "next baseline at 0.303",
    ),
    Case(
        "a tie built to be a tie: paired differences of both signs, equal throughput",
        (
            arm("baseline", (1.0, 1.2, 1.1), (100.0, 100.0, 100.0)),
            arm("chunk-512", (1.1, 1.1, 1.1), (100.0, 100.0, 100.0)),
        ),
        None,
        Outcome.NO_SIGNIFICANT_WINNER,
        tied=("baseline", "chunk-512"),
        says="no significant winner",
    ),
    Case(
        "noisy repeats whose pairs all agree: the load's noise cancels out",
        # The spreads overlap (1.0-3.0 against 1.2-3.2), yet in every repeat
        # chunk-512 served 0.2 req/s more on the same requests.
        (arm("baseline", (1.0, 2.0, 3.0)), arm("chunk-512", (1.2, 2.2, 3.2))),
        "chunk-512",
        says="against the next, baseline: +0.2 req/s",
    ),
    Case(
        "the best mean by a hair is no winner when one pair goes the other way",
        (arm("baseline", (2.0, 2.0, 2.0)), arm("chunk-512", (2.3, 2.3, 1.9))),
        None,
        Outcome.NO_SIGNIFICANT_WINNER,
        tied=("chunk-512", "baseline"),
        says="keep baseline",
    ),
    Case(
        "a consistent difference under 5% is no winner: arms that behave alike come out alike",
        (
            arm("baseline", (2.00, 2.10, 2.05), (100.0, 101.0, 99.0)),
            arm("chunk-4096", (2.02, 2.12, 2.07), (101.0, 102.0, 100.0)),
        ),
        None,
        Outcome.NO_SIGNIFICANT_WINNER,
        tied=("baseline", "chunk-4096"),
        says="or are under 5%",
    ),
    Case(
        "goodput tie broken by throughput in every pair",
        (
            arm("a", (2.0, 2.2, 2.1), (100.0, 101.0, 99.0)),
            arm("b", (2.1, 2.1, 2.1), (150.0, 151.0, 149.0)),
        ),
        "b",
        says="highest throughput",
    ),
    Case(
        "the best goodput breaks the TTFT objective",
        (arm("chunk-2048", (3.0, 3.1, 3.0), ttft=1.5), arm("chunk-512", (2.0, 2.1, 2.0))),
        "chunk-512",
        broke=("chunk-2048",),
        says="TTFT P99 1500 ms > objective 1000 ms",
    ),
    Case(
        "every arm breaks an objective",
        (arm("a", (3.0, 3.0), ttft=1.5), arm("b", (2.0, 2.0), tpot=0.2)),
        None,
        Outcome.NONE_MET,
        broke=("a", "b"),
        says="no arm met every objective",
    ),
    Case(
        "an arm run under other conditions than the workload's never wins",
        (
            arm("baseline", (1.0, 1.0, 1.0)),
            arm("chunk-512", (5.0, 5.0, 5.0), not_comparable="prefix-hit share 98% against the workload's 40%"),
        ),
        "baseline",
        broke=("chunk-512",),
        says="chunk-512 not comparable: prefix-hit share 98%",
    ),
    Case(
        "capacity decides when every contender measured it in every repeat",
        (
            arm("a", (3.0, 3.0, 3.0), capacity=(4.0, 4.1, 4.0)),
            arm("b", (2.0, 2.0, 2.0), capacity=(6.0, 6.2, 6.1)),
        ),
        "b",
        basis="capacity",
    ),
    Case(
        "capacity measured once cannot decide: goodput does",
        (arm("a", (3.0, 3.1, 3.0), capacity=(4.0,)), arm("b", (2.0, 2.0, 2.0), capacity=(6.0,))),
        "a",
    ),
    Case(
        "a failed arm is named and never wins",
        (arm("a", (9.0,), failed="worker w1 died mid-arm"), arm("b", (2.0, 2.0))),
        "b",
        broke=("a",),
        says="a failed: worker w1 died mid-arm",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recommend(case: Case) -> None:
    r = recommend(case.arms, SLO)
    assert (r.winner, r.outcome) == (case.winner, case.outcome), r.reasons
    assert tuple(sorted(r.broke)) == tuple(sorted(case.broke))
    assert tuple(sorted(r.tied)) == tuple(sorted(case.tied))
    assert r.basis == case.basis
    assert case.says in " ".join(r.reasons), r.reasons
    for name in case.broke:  # every arm set aside is named in the reasons
        assert any(reason.startswith(name) for reason in r.reasons)
    assert r.to_json()["outcome"] == case.outcome.value


def test_every_arm_is_set_beside_the_baseline_with_its_interval() -> None:
    arms = (
        arm("current", (1.0, 1.2, 1.1)),
        arm("chunk-512", (1.5, 1.8, 1.5)),
        arm("chunk-1024", (1.0, 1.3, 1.0)),
    )
    r = recommend(arms, SLO, baseline="current")
    assert r.baseline == "current" and set(r.versus_baseline) == {"chunk-512", "chunk-1024"}
    d = r.versus_baseline["chunk-512"]
    assert d.num_pairs == 3 and d.low <= d.mean <= d.high
    assert d.mean == pytest.approx(0.5)  # (0.5 + 0.6 + 0.4) / 3
    assert d.significant
    assert not r.versus_baseline["chunk-1024"].significant  # (0, +0.1, −0.1)


def test_the_interval_is_seeded_and_deterministic() -> None:
    a, b = (1.0, 1.4, 0.9, 1.3), (1.0, 1.0, 1.0, 1.0)
    d = paired_difference(a, b)
    assert d == paired_difference(a, b)
    assert -0.1 <= d.low < 0 < d.mean < d.high <= 0.4  # inside the range of the differences, and across zero
    assert not d.significant


def test_one_pair_is_never_significant_however_large() -> None:
    d = paired_difference((10.0,), (1.0,))
    assert d.mean == 9.0 and not d.significant
