"""The recommendation, as a table: a clear winner; a tie within the spread
over repeats (said, with no false winner); throughput breaking a goodput
tie; an arm breaking the TTFT objective; every arm breaking one; capacity
deciding when measured; a failed arm."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from controlplane.experiments.recommend import ArmFigures, Objectives, recommend

SLO = Objectives(ttft_p99_seconds=1.0, tpot_p99_seconds=0.1)


def arm(
    name: str,
    goodput: tuple[float, ...],
    throughput: tuple[float, ...] = (100.0,),
    ttft: float = 0.5,
    tpot: float = 0.05,
    capacity: tuple[float, ...] = (),
    failed: str = "",
) -> ArmFigures:
    n = len(goodput)
    return ArmFigures(name, goodput, throughput, (ttft,) * n, (tpot,) * n, (0.2,) * n, capacity, failed)


@dataclass(frozen=True)
class Case:
    name: str
    arms: tuple[ArmFigures, ...]
    winner: str | None
    broke: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    basis: str = "goodput"
    says: str = ""


CASES = [
    Case(
        "clear winner",
        (arm("baseline", (1.0, 1.1)), arm("chunk-512", (2.0, 2.1)), arm("chunk-1024", (1.5, 1.6))),
        "chunk-512",
        says="highest goodput",
    ),
    Case("one repeat: any difference decides", (arm("a", (1.00,)), arm("b", (1.01,))), "b"),
    Case(
        "tie within the spread over repeats: no false winner",
        (
            arm("chunk-512", (1.8, 2.2), (100.0, 120.0)),
            arm("chunk-1024", (1.9, 2.1), (105.0, 115.0)),
            arm("baseline", (1.0, 1.05)),
        ),
        None,
        tied=("chunk-1024", "chunk-512"),
        says="differ by less than their spread",
    ),
    Case(
        "goodput tie broken by throughput",
        (arm("a", (2.0, 2.2), (100.0, 101.0)), arm("b", (2.1, 2.1), (150.0, 151.0))),
        "b",
        says="highest throughput",
    ),
    Case(
        "the best goodput breaks the TTFT objective",
        (arm("chunk-2048", (3.0, 3.1), ttft=1.5), arm("chunk-512", (2.0, 2.1))),
        "chunk-512",
        broke=("chunk-2048",),
        says="TTFT P99 1500 ms > objective 1000 ms",
    ),
    Case(
        "every arm breaks an objective",
        (arm("a", (3.0,), ttft=1.5), arm("b", (2.0,), tpot=0.2)),
        None,
        broke=("a", "b"),
        says="no arm met every objective",
    ),
    Case(
        "capacity decides when every contender measured it",
        (arm("a", (3.0,), capacity=(4.0,)), arm("b", (2.0,), capacity=(6.0,))),
        "b",
        basis="capacity",
    ),
    Case(
        "a failed arm is named and never wins",
        (arm("a", (9.0,), failed="worker w1 died mid-arm"), arm("b", (2.0,))),
        "b",
        broke=("a",),
        says="a failed: worker w1 died mid-arm",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recommend(case: Case) -> None:
    r = recommend(case.arms, SLO)
    assert r.winner == case.winner
    assert tuple(sorted(r.broke)) == tuple(sorted(case.broke))
    assert tuple(sorted(r.tied)) == tuple(sorted(case.tied))
    assert r.basis == case.basis
    assert case.says in " ".join(r.reasons)
    for name in case.broke:  # every arm that broke an objective is named in the reasons
        assert any(reason.startswith(name) for reason in r.reasons)
