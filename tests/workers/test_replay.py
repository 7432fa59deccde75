"""Replay fidelity: a captured workload replayed as requests keeps the
captured length mix (two-sample KS below 0.05 on 2,000 draws), its prefix-hit
share (within 5 points), its rate and its burstiness."""

from __future__ import annotations

import bisect
import random
import statistics
from collections.abc import Sequence

import pytest

from workers.loadgen import plan
from workers.replay import (
    Histogram,
    Observed,
    WorkloadSpec,
    arrivals,
    capture,
    from_plan,
    sample,
    simulated_hit_share,
    vocabulary,
)

NUM_DRAWS = 2000


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic, exactly: the largest gap
    between the two empirical CDFs over every value either holds (scipy's
    ``ks_2samp(a, b).statistic``; scipy is not a dependency)."""
    xs, ys = sorted(a), sorted(b)
    return max(abs(bisect.bisect_right(xs, v) / len(xs) - bisect.bisect_right(ys, v) / len(ys)) for v in {*xs, *ys})


def long_tailed_traffic(seed: int, num: int = 3000, share_cached: float = 0.4) -> list[Observed]:
    """Lognormal prompts with a heavy tail, outputs of tens to hundreds of
    tokens, Poisson arrivals at 4/s; 60% of requests reuse a cached prefix."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num):
        t += rng.expovariate(4.0)
        prompt = max(1, int(rng.lognormvariate(5.5, 1.1)))
        cached = int(prompt * share_cached / 0.6) // 16 * 16 if rng.random() < 0.6 else 0
        out.append(Observed(t, prompt, rng.randint(8, 300), min(cached, prompt - 1)))
    return out


@pytest.fixture(scope="module")
def captured() -> tuple[list[Observed], WorkloadSpec]:
    observed = long_tailed_traffic(1)
    return observed, capture(observed, observed[-1].arrival_seconds)


def test_replayed_prompt_lengths_match_the_captured_ones(captured: tuple[list[Observed], WorkloadSpec]) -> None:
    observed, spec = captured
    planned = sample(spec, vocabulary=list(range(1000)), num_requests=NUM_DRAWS, seed=7)
    lengths = [len(r.prompt_token_ids or []) for r in planned]
    assert len(lengths) == NUM_DRAWS
    assert ks_statistic(lengths, [o.prompt_tokens for o in observed]) < 0.05
    # the long tail survives: the largest captured prompts are drawn too
    assert max(lengths) > sorted(o.prompt_tokens for o in observed)[int(0.99 * len(observed))]


def test_replayed_output_lengths_match_the_captured_ones(captured: tuple[list[Observed], WorkloadSpec]) -> None:
    observed, spec = captured
    planned = sample(spec, vocabulary=list(range(1000)), num_requests=NUM_DRAWS, seed=8)
    assert ks_statistic([r.max_tokens for r in planned], [o.output_tokens for o in observed]) < 0.05


@pytest.mark.parametrize("share", [0.0, 0.2, 0.4, 0.55])
def test_replayed_prefix_hit_share_is_within_five_points(share: float) -> None:
    observed = long_tailed_traffic(2, share_cached=share)
    spec = capture(observed, observed[-1].arrival_seconds)
    planned = sample(spec, vocabulary=list(range(1000)), num_requests=NUM_DRAWS, seed=9)
    assert abs(simulated_hit_share(planned) - spec.prefix_hit_share) < 0.05
    assert abs(spec.prefix_hit_share - share) < 0.05  # and the capture measured what the traffic had


def test_the_ks_statistic_sees_a_shifted_distribution() -> None:
    rng = random.Random(0)
    same = [rng.randint(1, 1000) for _ in range(NUM_DRAWS)]
    assert ks_statistic(same, same) == 0.0
    assert ks_statistic(same, [v + 100 for v in same]) > 0.05


def test_a_prompt_without_shared_prefix_shares_no_block() -> None:
    spec = capture(long_tailed_traffic(3, share_cached=0.0), 750.0)
    planned = sample(spec, vocabulary=list(range(1000)), num_requests=500, seed=1)
    assert simulated_hit_share(planned) == 0.0


def test_arrivals_keep_the_rate_and_the_burstiness() -> None:
    rng = random.Random(0)
    for cv in (0.5, 1.0, 3.0):
        times = arrivals(rng, 5.0, cv, num_requests=NUM_DRAWS)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert abs(statistics.mean(gaps) * 5.0 - 1.0) < 0.1
        assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - cv) < 0.15 * cv


def test_capture_rates_traffic_that_began_inside_the_window_from_when_it_began() -> None:
    # A 900 s window whose traffic started 180 s before its end (a fleet just
    # started): 1 request/s, not 180/900.
    observed = [Observed(720.0 + i, 100, 10) for i in range(180)]
    assert capture(observed, 900.0).rate_per_second == 1.0


def test_capture_reads_rate_and_burstiness_from_arrivals() -> None:
    observed = [Observed(i * 0.5, 100, 10) for i in range(100)]
    spec = capture(observed, 50.0)
    assert spec.rate_per_second == 2.0
    assert spec.burstiness < 1e-6  # evenly spaced
    assert spec.prefix_hit_share == 0.0


def test_capture_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError):
        capture([], 60.0)


def test_a_workload_round_trips_through_json(captured: tuple[list[Observed], WorkloadSpec]) -> None:
    _, spec = captured
    assert WorkloadSpec.from_dict(spec.to_dict()) == spec


def test_histogram_buckets_are_fine_and_contiguous() -> None:
    h = Histogram.of([1, 2, 3, 500, 10_000])
    assert h.total == 5
    widths = [(b - a) / a for a, b in zip(h.edges, h.edges[1:], strict=False) if a > 100]
    assert max(widths) <= 0.05
    assert h.edges[0] == 1 and h.edges[-1] > 10_000


def test_a_loadgen_scenario_becomes_a_workload() -> None:
    planned = plan("long-tail", duration_seconds=200, rate=3.0, seed=1)
    spec = from_plan(planned, 200.0)
    assert spec.num_requests == len(planned)
    assert abs(spec.rate_per_second - 3.0) < 0.5
    assert spec.prefix_hit_share == 0.0
    chat = from_plan(plan("chat", duration_seconds=100, rate=2.0, seed=1), 100.0)
    assert chat.prefix_hit_share > 0.3  # each turn resends its history


def test_prompts_use_the_models_own_tokenizer(tiny_model: object) -> None:
    ids = vocabulary(str(tiny_model))
    assert len(ids) > 100
    spec = capture(long_tailed_traffic(4, num=200), 50.0)
    planned = sample(spec, vocabulary=ids, num_requests=50, seed=2, max_model_len=1024)
    assert all(set(r.prompt_token_ids or []) <= set(ids) for r in planned)
    assert all(len(r.prompt_token_ids or []) + r.max_tokens <= 1024 for r in planned)


def test_the_command_refuses_a_file_that_is_no_workload(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from workers.__main__ import main

    bad = Path(str(tmp_path)) / "w.json"
    bad.write_text('{"spec": {"rate_per_second": 1}}')
    assert main(["replay", "--url", "http://127.0.0.1:9", "--workload", str(bad)]) == 2
    assert "error:" in capsys.readouterr().err


# ---- equal conditions for an experiment's arms (issue 23) ---------------------------------


def correlated_traffic(num: int = 3000) -> list[Observed]:
    """Long prompts get short answers and short prompts long ones: a joint
    shape the marginals alone cannot reproduce."""
    rng = random.Random(5)
    out = []
    for i in range(num):
        prompt = rng.randint(10, 2000)
        out.append(Observed(i * 0.25, prompt, max(1, 2100 - prompt + rng.randint(-50, 50))))
    return out


def correlation(pairs: Sequence[tuple[int, int]]) -> float:
    xs, ys = [float(a) for a, _ in pairs], [float(b) for _, b in pairs]
    return statistics.correlation(xs, ys)


def test_prompt_and_output_lengths_are_drawn_jointly_as_captured() -> None:
    observed = correlated_traffic()
    spec = capture(observed, 750.0)
    planned = sample(spec, vocabulary=list(range(1000)), num_requests=NUM_DRAWS, seed=3)
    drawn = correlation([(req.target_prompt_tokens or 0, req.max_tokens) for req in planned])
    captured = correlation([(o.prompt_tokens, o.output_tokens) for o in observed])
    assert captured < -0.95
    assert abs(drawn - captured) < 0.05


def test_a_spec_stored_before_the_joint_histogram_still_replays() -> None:
    spec = capture(correlated_traffic(), 750.0)
    old = spec.to_dict()
    del old["joint"]
    legacy = WorkloadSpec.from_dict(old)
    assert legacy.joint == ()
    planned = sample(legacy, vocabulary=list(range(1000)), num_requests=NUM_DRAWS, seed=3)
    # Independent draws from the marginals: the captured correlation is lost, but the lengths are as captured.
    assert abs(correlation([(req.target_prompt_tokens or 0, req.max_tokens) for req in planned])) < 0.1
    assert (
        ks_statistic([r.target_prompt_tokens or 0 for r in planned], [o.prompt_tokens for o in correlated_traffic()])
        < 0.05
    )


@pytest.mark.parametrize("cv", [1.0, 11.7])
def test_a_replay_over_a_duration_offers_exactly_the_recorded_rate(cv: float) -> None:
    # A fresh gamma process started at t=0 offered a cv-11.7 capture 87
    # requests in 20 s against 32 expected, and one seed 259.
    counts = {len(arrivals(random.Random(seed), 1.6, cv, duration_seconds=20.0)) for seed in range(50)}
    assert counts == {32}
    times = arrivals(random.Random(0), 1.6, cv, duration_seconds=20.0)
    assert times == sorted(times) and 0.0 <= times[0] and times[-1] <= 20.0


def test_arrivals_start_from_a_stationary_state() -> None:
    # Counted over a window, a renewal process started on an arrival offers
    # about (cv² − 1) / 2 requests too many (12 here); one seen from a
    # stationary start offers rate × window on average.
    rate, cv, window = 5.0, 5.0, 20.0
    counts = [
        sum(1 for t in arrivals(random.Random(seed), rate, cv, num_requests=400) if t < window) for seed in range(1000)
    ]
    assert abs(statistics.mean(counts) - rate * window) < 5.0


def test_one_seed_is_the_same_requests_whatever_the_arms_block_size() -> None:
    spec = capture(long_tailed_traffic(4), 750.0)
    a = sample(spec, vocabulary=list(range(1000)), duration_seconds=30.0, seed=2, block_size=16)
    b = sample(spec, vocabulary=list(range(1000)), duration_seconds=30.0, seed=2, block_size=32)
    assert [(r.start_seconds, r.target_prompt_tokens, r.max_tokens) for r in a] == [
        (r.start_seconds, r.target_prompt_tokens, r.max_tokens) for r in b
    ]
    assert len(a) == round(spec.rate_per_second * 30.0)
    c = sample(spec, vocabulary=list(range(1000)), duration_seconds=30.0, seed=3, block_size=16)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def hit_share_on(planned: Sequence[object], num_caches: int, block_size: int = 16) -> float:
    """What ``num_caches`` cold caches serve when the requests are dealt round-robin."""
    hits = total = 0.0
    for c in range(num_caches):
        share = list(planned)[c::num_caches]
        tokens = sum(len(r.prompt_token_ids or []) for r in share)  # type: ignore[attr-defined]
        hits += simulated_hit_share(share, block_size) * tokens  # type: ignore[arg-type]
        total += tokens
    return hits / total


@pytest.mark.parametrize(
    ("share", "num_requests", "num_caches"),
    [(0.2, 40, 1), (0.2, 40, 2), (0.2, 80, 3), (0.5, 120, 1), (0.5, 120, 2)],
)
def test_a_short_replay_reproduces_the_prefix_share_on_cold_caches(
    share: float, num_requests: int, num_caches: int
) -> None:
    # The first reusing request on each cache computes the prefix cold,
    # which the sampler makes up for. (A high share on few requests can fall
    # short: a short first prompt stores a short prefix. The arm's measured
    # share says so.)
    spec = capture(long_tailed_traffic(6, share_cached=share), 750.0)
    for seed in range(5):
        planned = sample(
            spec, vocabulary=list(range(1000)), num_requests=num_requests, seed=seed, num_caches=num_caches
        )
        assert abs(hit_share_on(planned, num_caches) - spec.prefix_hit_share) < 0.1 * spec.prefix_hit_share
