"""The figures ("Metrics" in docs/architecture.md) from hand-made records: the arithmetic the bench,
the load generator and the server share."""

from __future__ import annotations

import pytest

from workers import figures
from workers.engines.api import RequestMetrics, StepMetrics


def request(arrival: float, tokens: list[float], prompt: int = 10, scheduled: float | None = None) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=arrival if scheduled is None else scheduled,
        first_token_time=tokens[0] if tokens else None,
        token_times=tokens,
        finished_time=tokens[-1] if tokens else None,
        num_prompt_tokens=prompt,
        num_output_tokens=len(tokens),
    )


def step(
    start: float,
    duration: float,
    memory: int,
    peak: int | None = None,
    held: int = 2,
    stored: int = 20,
    waits: list[float] | None = None,
) -> StepMetrics:
    return StepMetrics(
        start_time=start,
        duration_seconds=duration,
        num_prefill_tokens=0,
        num_decode_tokens=1,
        num_running=1,
        num_waiting=0,
        num_blocks_held=held,
        num_tokens_stored=stored,
        block_size=16,
        num_blocks_total=100,
        memory_bytes=memory,
        peak_memory_bytes=peak if peak is not None else memory,
        prefill_chunk_waits=waits or [],
    )


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    assert figures.percentile([1, 2, 3, 4], 50) == 2.5
    assert figures.percentile([5], 99) == 5
    assert figures.percentile(range(101), 99) == 99
    assert figures.percentile([], 50) is None
    with pytest.raises(ValueError):
        figures.percentile([1], 101)


def test_ttft_tpot_and_gaps_of_one_request() -> None:
    m = request(10.0, [10.5, 10.6, 12.6, 12.7], scheduled=10.2)
    assert figures.ttft_seconds(m) == pytest.approx(0.5)
    assert figures.queue_seconds(m) == pytest.approx(0.2)
    assert figures.token_gaps(m) == pytest.approx([0.1, 2.0, 0.1])
    assert figures.max_gap_seconds(m) == pytest.approx(2.0)
    assert figures.tpot_seconds(m) == pytest.approx(2.2 / 3)
    assert figures.max_gap_seconds(request(0, [1.0])) is None


def test_stalls_take_each_requests_largest_gap_so_a_rare_long_gap_is_not_hidden() -> None:
    # 100 requests, 50 gaps each of 10 ms; one request has a single 3 s gap.
    reqs = [request(0, [0.01 * i for i in range(51)]) for _ in range(99)]
    reqs.append(request(0, [0.01 * i for i in range(50)] + [0.49 + 3.0]))
    all_gaps = [g for m in reqs for g in figures.token_gaps(m)]
    assert figures.percentile(all_gaps, 99) == pytest.approx(0.01)  # whole-run ITL P99 hides it
    assert figures.stalls_seconds(reqs, 100) == pytest.approx(3.0)
    assert figures.stalls_seconds(reqs, 99) > 0.01


def test_goodput_counts_requests_meeting_both_objectives() -> None:
    slo = figures.SLO(ttft_seconds=1.0, tpot_seconds=0.1)
    ok = request(0, [0.5, 0.55, 0.6])
    slow_first = request(0, [1.5, 1.55])
    slow_rest = request(0, [0.5, 0.9, 1.3])
    assert figures.goodput([ok, slow_first, slow_rest], slo, 2.0) == 0.5


def test_memory_mean_is_time_weighted_and_peak_includes_transients() -> None:
    steps = [step(0.0, 1.0, 100, peak=300), step(1.0, 1.0, 100), step(2.0, 1.0, 400), step(5.0, 1.0, 100)]
    # 100 held 1→2, 100 held 2→3, 400 held 3→6, last 100 for its own 1 s
    out = figures.memory_figures(steps)
    assert out["memory_peak_bytes"] == 400
    assert out["memory_mean_bytes"] == pytest.approx((100 + 100 + 400 * 3 + 100) / 6)
    assert out["memory_peak_over_mean"] == pytest.approx(400 / out["memory_mean_bytes"])


def test_fragmentation_is_one_minus_stored_over_capacity() -> None:
    s = step(0, 1, 0, held=3, stored=40)
    assert s.kv_fragmentation == pytest.approx(1 - 40 / 48)
    assert step(0, 1, 0, held=0, stored=0).kv_fragmentation is None
    out = figures.fragmentation_figures([s, step(1, 1, 0, held=2, stored=32)])
    assert out["kv_fragmentation_max"] == pytest.approx(1 - 40 / 48)
    # first value held from its end (1) to the next end (2), the last for its own second
    assert out["kv_fragmentation_mean"] == pytest.approx(((1 - 40 / 48) + 0.0) / 2)


def test_prefill_wait_figures_pool_every_chunk() -> None:
    out = figures.prefill_wait_figures([step(0, 1, 0, waits=[0.1, 0.3]), step(1, 1, 0, waits=[0.2])])
    assert out["prefill_wait_mean_seconds"] == pytest.approx(0.2)
    assert out["prefill_wait_p99_seconds"] == pytest.approx(0.298)


def test_gaps_overlapping_a_long_prefill() -> None:
    short = request(0, [1.0, 1.1, 3.0, 3.1])
    long = request(0.5, [3.05], prompt=8000, scheduled=1.2)
    intervals = figures.prefill_intervals([short, long], min_prompt_tokens=4000)
    assert intervals == [(1.2, 3.05)]
    assert figures.gaps_overlapping([short], intervals) == pytest.approx([1.9, 0.1])


def test_prompt_buckets_follow_design() -> None:
    assert [figures.prompt_bucket(n) for n in (1, 512, 513, 2048, 8192, 32768, 40000)] == [
        "<=512",
        "<=512",
        "<=2K",
        "<=2K",
        "<=8K",
        "<=32K",
        ">32K",
    ]


def test_summarize_reports_every_design_figure() -> None:
    reqs = [request(0, [0.5, 0.6, 0.7]), request(0.2, [1.0, 1.5], prompt=1500)]
    out = figures.summarize(reqs, [step(0, 0.5, 100), step(0.5, 0.5, 200)], 2.0, figures.SLO(1.0, 0.2))
    for key in (
        "ttft_p99_seconds",
        "itl_p99_seconds",
        "stall_p99_seconds",
        "tpot_p50_seconds",
        "queue_p99_seconds",
        "output_throughput_tps",
        "goodput_rps",
        "memory_peak_over_mean",
        "kv_fragmentation_mean",
        "prefill_wait_p99_seconds",
        "preemptions",
        "prefix_hit_rate",
        "prefill_share",
    ):
        assert key in out
    assert out["output_throughput_tps"] == 2.5
    assert out["goodput_rps"] == 0.5
    assert set(figures.by_prompt_bucket(reqs)) == {"<=512", "<=2K"}
