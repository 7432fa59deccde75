"""The gateway benchmark's arithmetic (``controlplane.bench.gateway.summary``):
added latency pooled over all rounds and round by round against the direct
target's same round. Pure: TTFTs made up here."""

from __future__ import annotations

import pytest

from controlplane.bench import gateway as bench


def target(name: str, rounds: list[list[float]]) -> bench.Target:
    t = bench.Target(name, "http://unused")
    for values in rounds:
        t.ttfts += values
        t.round_ends.append(len(t.ttfts))
    return t


def steady(base: float, n: int = 100) -> list[float]:
    return [base + i * 1e-5 for i in range(n)]  # 100 values 10 µs apart


def test_added_latency_is_the_difference_of_percentiles_pooled_and_round_by_round() -> None:
    direct = target("direct", [steady(0.020), steady(0.020)])
    proxy = target("gateway", [steady(0.0205), steady(0.0205)])  # 0.5 ms more, every request
    figures = bench.summary([direct, proxy, target("nginx", [steady(0.0201), steady(0.0201)])])
    for q in (50, 99):
        assert figures["gateway"][f"added_p{q}_ms"] == pytest.approx(0.5)
        assert figures["gateway"][f"round_added_p{q}_ms"] == pytest.approx(0.5)
        assert figures["nginx"][f"round_added_p{q}_ms"] == pytest.approx(0.1)


def test_a_burst_in_one_phase_moves_the_pooled_p99_but_not_the_median_of_the_rounds() -> None:
    """Someone else's work slows one direct phase by 5 ms at its tail: pooled,
    the proxy looks faster than calling the worker; round by round it does not."""
    burst = steady(0.020)[:95] + [0.025] * 5
    direct = target("direct", [steady(0.020), burst, steady(0.020)])
    proxy = target("gateway", [steady(0.0205)] * 3)
    figures = bench.summary([direct, proxy, target("nginx", [steady(0.0201)] * 3)])["gateway"]
    assert figures["added_p99_ms"] < 0  # the pooled figure is fooled
    assert figures["round_added_p99_ms"] == pytest.approx(0.5)


def test_the_ratio_to_nginx_is_withheld_when_nginx_adds_nothing_measurable() -> None:
    assert bench.ratio(0.6, 0.2) == pytest.approx(3.0)
    assert bench.ratio(0.6, 0.01) is None and bench.ratio(0.6, -0.3) is None
    assert bench.times(None).startswith("n/a")
