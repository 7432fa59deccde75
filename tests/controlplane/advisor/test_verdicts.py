"""The advisor's verdicts on constructed figures, as tables: each question yes,
no and not-enough-data, with the boundaries; the overall verdict; the knobs;
the tuning findings; the PD estimate against a hand computation. Pure."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from controlplane.advisor.verdicts import (
    Answer,
    Engine,
    Finding,
    Gaps,
    Inputs,
    Overall,
    Profile,
    Requests,
    Samples,
    Thresholds,
    Throughput,
    advise,
    budget_too_large,
    chunk_too_small,
    concurrency,
    head_of_line,
    knobs,
    kv_bytes_per_token,
    long_tail,
    memory,
    overall,
    pd_estimate,
    prefix_hits_by_bucket,
    starvation,
)
from workers.engines.reference.tiny import MODEL_CONFIG as TINY_CONFIG

T = Thresholds(min_requests=100, min_samples=20, min_gaps=50)
NAN = math.nan


def requests(lengths: list[int], cached: list[int | None] | None = None) -> Requests:
    n = len(lengths)
    return Requests(
        lengths, cached if cached is not None else [None] * n, [float(i) for i in range(n)], [0.1] * n, [True] * n
    )


def samples(
    n: int,
    *,
    waiting: float = 0,
    running: float = 1,
    kv: float = 0.1,
    seats: float = 8,
    peak: float = 100.0,
    preempt: float = 0,
    long_steps: float = 0,
    saturated: int = 0,
) -> Samples:
    """``n`` scrapes of one worker; the first ``saturated`` have waiting requests at max_num_seqs."""
    return Samples(
        worker=[1] * n,
        waiting=[3.0 if i < saturated else waiting for i in range(n)],
        running=[seats if i < saturated else running for i in range(n)],
        kv_usage=[kv] * n,
        max_num_seqs=[seats] * n,
        memory_peak_bytes=[peak] * n,
        preemptions_delta=[preempt] * n,
        long_prefill_steps_delta=[long_steps] * n,
    )


NO_GAPS = Gaps(None, None, 0, 0, 1024)
ENGINE = Engine(None, None, None, None, None)


def inputs(**changes: object) -> Inputs:
    base = Inputs(requests([100] * 200), samples(100), None, 0.0, 1.0, NO_GAPS, ENGINE, None)
    return replace(base, **changes)  # type: ignore[arg-type]


# ---- long tail ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "answer", "why"),
    [
        ([100] * 99, Answer.NOT_ENOUGH_DATA, "Only 99 requests"),
        ([], Answer.NOT_ENOUGH_DATA, "Only 0 requests"),
        ([100] * 200, Answer.NO, "no long tail"),
        # 5% over 8K exactly: at the threshold is yes
        ([100] * 95 + [9000] * 5, Answer.YES, "5.0% of prompts are over 8192"),
        # 4%: the share says no; P99 lands in the long prompts: the ratio says yes
        ([100] * 96 + [9000] * 4, Answer.YES, "the median"),
        # 8192 itself is not over the threshold; P99/P50 = 8192/1024 = 8: yes by the ratio, exactly at it
        ([1024] * 90 + [8192] * 10, Answer.YES, "8.0× the median"),
        # just under the ratio and no prompt over 8K
        ([1024] * 90 + [8000] * 10, Answer.NO, "no long tail"),
    ],
)
def test_long_tail(lengths: list[int], answer: Answer, why: str) -> None:
    finding = long_tail(requests(lengths), T)
    assert finding.answer == answer
    assert why in " ".join(finding.reasons)
    assert finding.num_samples == len(lengths)
    assert sum(finding.chart["values"]) == len(lengths)


# ---- concurrency ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "answer", "why"),
    [
        (inputs(samples=samples(19)), Answer.NOT_ENOUGH_DATA, "Only 19 scrapes"),
        (inputs(samples=samples(100)), Answer.NO, "not held back"),
        # 10 of 100 scrapes saturated with waiting: exactly the 10% threshold
        (inputs(samples=samples(100, saturated=10)), Answer.YES, "in 10.0% of scrapes"),
        (inputs(samples=samples(100, saturated=9)), Answer.NO, "only 9.0%"),
        # waiting at a nearly full KV cache counts too (90% is nearly full)
        (inputs(samples=samples(100, waiting=1, kv=0.90)), Answer.YES, "KV cache over 90%"),
        (inputs(samples=samples(100, waiting=1, kv=0.89)), Answer.NO, "not held back"),
        # full but nobody waiting is not held back
        (inputs(samples=samples(100, waiting=0, running=8)), Answer.NO, "not held back"),
        # queue P99 at the threshold with preemptions: yes; without preemptions: no
        (inputs(queue_p99_seconds=1.0, num_preemptions=3.0), Answer.YES, "Queue time P99 is 1.00 s"),
        (inputs(queue_p99_seconds=1.0, num_preemptions=0.0), Answer.NO, "not held back"),
        (inputs(queue_p99_seconds=0.99, num_preemptions=3.0), Answer.NO, "not held back"),
    ],
)
def test_concurrency(case: Inputs, answer: Answer, why: str) -> None:
    finding = concurrency(case, T)
    assert finding.answer == answer
    assert why in " ".join(finding.reasons)


# ---- memory ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "answer", "why"),
    [
        (inputs(samples=samples(19)), Answer.NOT_ENOUGH_DATA, "Only 19 scrapes"),
        (inputs(memory_peak_to_mean=None), Answer.NOT_ENOUGH_DATA, "no memory figures"),
        (inputs(memory_peak_to_mean=1.49, samples=samples(100, kv=0.95)), Answer.NO, "not what limits"),
        (inputs(memory_peak_to_mean=1.5, samples=samples(100, kv=0.90)), Answer.YES, "90% full"),
        (inputs(memory_peak_to_mean=1.5, samples=samples(100, kv=0.5)), Answer.NO, "has room at the peaks"),
        (
            inputs(memory_peak_to_mean=2.0, samples=samples(100, kv=0.5, preempt=1, long_steps=1)),
            Answer.YES,
            "100 preemptions happened while a long prefill ran",
        ),
        # preemptions with no long prefill beside them do not count
        (
            inputs(memory_peak_to_mean=2.0, samples=samples(100, kv=0.5, preempt=1, long_steps=0)),
            Answer.NO,
            "no preemption lines up",
        ),
    ],
)
def test_memory(case: Inputs, answer: Answer, why: str) -> None:
    finding = memory(case, T)
    assert finding.answer == answer
    assert why in " ".join(finding.reasons)


def test_kv_usage_at_peaks_reads_each_workers_own_peaks() -> None:
    # worker 1 peaks at 200 with a full cache; worker 2's small peak (50) is its own peak too
    s = Samples([1, 1, 2, 2], [0] * 4, [1] * 4, [0.2, 0.95, 0.1, 0.87], [8] * 4, [100, 200, 40, 50], [0] * 4, [0] * 4)
    finding = memory(inputs(samples=s, memory_peak_to_mean=2.0), replace(T, min_samples=1))
    assert finding.figures["kv_usage_at_peaks"] == pytest.approx(0.91)
    assert finding.answer == Answer.YES


# ---- head-of-line blocking -------------------------------------------------------------


@pytest.mark.parametrize(
    ("gaps", "answer", "ratio"),
    [
        (Gaps(0.4, 0.1, 49, 500, 1024), Answer.NOT_ENOUGH_DATA, 4.0),
        (Gaps(0.4, 0.1, 500, 49, 1024), Answer.NOT_ENOUGH_DATA, 4.0),
        (Gaps(None, 0.1, 0, 500, 1024), Answer.NOT_ENOUGH_DATA, None),
        (Gaps(0.2, 0.1, 50, 50, 1024), Answer.YES, 2.0),
        (Gaps(0.199, 0.1, 50, 50, 1024), Answer.NO, 1.99),
        (Gaps(0.05, 0.05, 80, 900, 1024), Answer.NO, 1.0),
    ],
)
def test_head_of_line(gaps: Gaps, answer: Answer, ratio: float | None) -> None:
    finding = head_of_line(gaps, T)
    assert finding.answer == answer
    assert finding.figures["ratio"] == (pytest.approx(ratio) if ratio is not None else None)


def test_head_of_line_says_when_it_is_approximate() -> None:
    finding = head_of_line(Gaps(0.5, 0.1, 60, 60, 1024, approximate=True), T)
    assert finding.approximate
    assert "approximate" in finding.reasons[0]


# ---- the overall verdict ------------------------------------------------------------------


def q(answer: Answer) -> Finding:
    return Finding("q", "Q?", answer, 10, {}, {}, [f"because {answer.value}"])


Y, N, U = Answer.YES, Answer.NO, Answer.NOT_ENOUGH_DATA


@pytest.mark.parametrize(
    ("answers", "verdict"),
    [
        ((Y, Y, Y), Overall.WORTH_IT),
        ((Y, Y, N), Overall.WORTH_IT),
        ((Y, N, Y), Overall.WORTH_IT),
        ((U, Y, Y), Overall.WORTH_IT),
        ((Y, N, N), Overall.NOT_WORTH_IT),
        ((N, N, N), Overall.NOT_WORTH_IT),
        ((U, N, N), Overall.NOT_WORTH_IT),
        ((Y, U, N), Overall.NOT_ENOUGH_DATA),  # the unknown one could make it two
        ((U, U, N), Overall.NOT_ENOUGH_DATA),
        ((U, U, U), Overall.NOT_ENOUGH_DATA),
    ],
)
def test_overall_is_two_of_three(answers: tuple[Answer, Answer, Answer], verdict: Overall) -> None:
    result, reasons = overall([q(a) for a in answers], q(N))
    assert result == verdict
    assert reasons
    if verdict == Overall.WORTH_IT:
        assert reasons[: answers.count(Y)] == ["because yes"] * answers.count(Y)


# ---- starting knobs ------------------------------------------------------------------------


def test_knobs_from_memory_left_after_weights() -> None:
    gib = 2**30
    engine = Engine(
        device_memory_bytes=80 * gib,
        weight_bytes=16 * gib,
        activation_bytes_per_token=4 * 2**20,
        kv_bytes_per_token=None,
        prefill_seconds_per_token=None,
    )
    profile = Profile("monolithic", 8192, 8192, max_num_seqs=64, block_size=16)
    lengths = [100] * 50 + [300] * 50 + [20_000] * 10
    k = knobs(inputs(engine=engine, profile=profile, requests=requests(lengths, [0] * 110)), T)
    # (80 − 16) GiB × ¼ / 4 MiB = 4096 tokens; × ⅓ = 5461 → 5456 (a multiple of the block size)
    assert (k.chunk_tokens, k.chunk_tokens_high) == (4096, 5456)
    assert k.max_num_batched_tokens == 4096 + 64
    # median of 110 lengths is 300 (rounded up to the block size: 304)
    assert k.short_prompt_threshold == 304
    assert k.profile_fields() == {
        "prefill_mode": "chunked",
        "max_num_batched_tokens": 4160,
        "long_prefill_token_threshold": 4096,
        "short_prompt_threshold": 304,
    }


def test_short_prompt_threshold_counts_tokens_left_after_the_prefix_hit() -> None:
    # long prompts whose cached prefixes leave 96 tokens each: they are short prefills
    k = knobs(inputs(requests=requests([100_000] * 10, [99_904] * 10)), T)
    assert k.short_prompt_threshold == 96
    assert k.chunk_tokens is None  # no memory facts from the workers
    assert "do not report" in k.reasons[0]


def test_knobs_chunk_never_exceeds_the_model_length() -> None:
    engine = Engine(2**40, 0, 1000.0, None, None, max_model_len=32768)
    k = knobs(inputs(engine=engine, profile=Profile("chunked", 512, 512, 8)), T)
    assert k.chunk_tokens == k.chunk_tokens_high == 32768


# ---- tuning findings on a chunked pool -------------------------------------------------------


def pool(tps: float, stall: float, n: int = 200, mode: str = "chunked", name: str = "") -> Throughput:
    return Throughput(tps, stall, n, mode, name)


@pytest.mark.parametrize(
    ("mine", "base", "answer"),
    [
        (pool(80, 0.1), None, Answer.NOT_ENOUGH_DATA),
        (pool(80, 0.1, n=99), pool(100, 1.0, mode="monolithic"), Answer.NOT_ENOUGH_DATA),
        (pool(84, 0.1), pool(100, 1.0, mode="monolithic"), Answer.YES),  # 16% down, stalls better
        (pool(86, 0.1), pool(100, 1.0, mode="monolithic"), Answer.NO),  # 14%: within the threshold
        (pool(50, 2.0), pool(100, 1.0, mode="monolithic"), Answer.NO),  # stalls did not improve
    ],
)
def test_chunk_too_small(mine: Throughput, base: Throughput | None, answer: Answer) -> None:
    finding = chunk_too_small(inputs(pool=mine, baseline=base), T)
    assert finding.answer == answer
    if answer == Answer.YES:
        assert (finding.knob, finding.direction) == ("long_prefill_token_threshold", "raise")


@pytest.mark.parametrize(
    ("mine", "base", "gaps", "answer"),
    [
        # against a monolithic baseline: 2× better is enough, 1.9× is not
        (pool(100, 0.5), pool(100, 1.0, mode="monolithic", name="mono"), NO_GAPS, Answer.NO),
        (pool(100, 0.53), pool(100, 1.0, mode="monolithic", name="mono"), NO_GAPS, Answer.YES),
        # no monolithic baseline: the pool's own long prefills still stall its decodes
        (pool(100, 0.5), None, Gaps(0.4, 0.1, 60, 60, 1024), Answer.YES),
        (pool(100, 0.5), pool(100, 1.0, mode="chunked"), Gaps(0.12, 0.1, 60, 60, 1024), Answer.NO),
        (pool(100, 0.5), None, NO_GAPS, Answer.NOT_ENOUGH_DATA),
    ],
)
def test_budget_too_large(mine: Throughput, base: Throughput | None, gaps: Gaps, answer: Answer) -> None:
    finding = budget_too_large(inputs(pool=mine, baseline=base), head_of_line(gaps, T), T)
    assert finding.answer == answer
    if answer == Answer.YES:
        assert (finding.knob, finding.direction) == ("max_num_batched_tokens", "lower")


def log(rows: list[tuple[float, int, float]]) -> Requests:
    """(arrival, prompt tokens, TTFT) rows, all successful."""
    return Requests(
        [r[1] for r in rows], [None] * len(rows), [r[0] for r in rows], [r[2] for r in rows], [True] * len(rows)
    )


def test_starvation_of_long_prompts_names_min_prefill_tokens() -> None:
    # short ones: 100 tokens in 0.01 s (1e-4 s/token); long ones 10K tokens in 4 s (4e-4 s/token): 4×
    rows = [(float(i), 100, 0.01) for i in range(100)] + [(100.0 + i * 10, 10_000, 4.0) for i in range(5)]
    long_starved, _ = starvation(log(rows), T)
    assert long_starved.answer == Answer.YES
    assert (long_starved.knob, long_starved.direction) == ("min_prefill_tokens_per_step", "raise")
    rows = [(float(i), 100, 0.01) for i in range(100)] + [(100.0 + i * 10, 10_000, 2.0) for i in range(5)]
    assert starvation(log(rows), T)[0].answer == Answer.NO  # 2× < 3×


def test_starvation_of_short_prompts_during_long_prefills() -> None:
    # a long prompt arrives at 0 and gets its first token at 10; short ones inside that wait 0.5 s, others 0.05 s
    rows = [(0.0, 20_000, 10.0)] + [(0.5 + i * 0.5, 100, 0.5) for i in range(19)]
    rows += [(20.0 + i, 100, 0.05) for i in range(100)]
    _, short_starved = starvation(log(rows), T)
    assert short_starved.answer == Answer.YES
    assert (short_starved.knob, short_starved.direction) == ("long_prefill_token_threshold", "lower")
    assert short_starved.figures["ratio"] == pytest.approx(10.0)


def test_starvation_without_long_prompts_is_not_enough_data() -> None:
    rows = [(float(i), 100, 0.01) for i in range(200)]
    assert [f.answer for f in starvation(log(rows), T)] == [Answer.NOT_ENOUGH_DATA] * 2


# ---- PD estimate -------------------------------------------------------------------------------

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
STALLS = head_of_line(Gaps(0.5, 0.1, 60, 60, 1024), T)


def test_kv_bytes_per_token_by_hand() -> None:
    # tiny: 2 (K, V) × 2 layers × 2 KV heads × 64 head size × 4 bytes (float32)
    assert kv_bytes_per_token({**TINY_CONFIG, "torch_dtype": "float32"}) == 2 * 2 * 2 * 64 * 4 == 2048
    # Llama-3-8B: 2 × 32 × 8 × (4096 / 32 = 128) × 2 bytes (bf16) = 128 KiB
    assert kv_bytes_per_token(LLAMA_3_8B) == 131072


def test_pd_estimate_for_llama_3_8b_by_hand() -> None:
    # 131072 B at 25 GB/s = 5.24288 µs per token; prefill 50 µs per token → 10.5% of it
    finding = pd_estimate(131072, 50e-6, STALLS, T)
    assert finding.figures["transfer_seconds_per_token"] == pytest.approx(131072 / 25e9)
    assert finding.figures["transfer_share"] == pytest.approx(5.24288e-6 / 50e-6)
    assert finding.answer == Answer.YES
    assert "estimate" in finding.title and "estimate" in finding.reasons[0]
    assert "÷" in finding.chart["formula"]
    # a fast prefill (8 µs per token) makes the transfer cost more than half of it
    assert pd_estimate(131072, 8e-6, STALLS, T).answer == Answer.NO


def test_pd_estimate_for_the_tiny_model_by_hand() -> None:
    # 2048 B / 25e9 B/s = 81.92 ns per token against a 100 µs CPU prefill per token
    finding = pd_estimate(kv_bytes_per_token({**TINY_CONFIG, "torch_dtype": "float32"}), 100e-6, STALLS, T)
    assert finding.figures["transfer_share"] == pytest.approx(81.92e-9 / 100e-6)
    # a slower link (1 GB/s) still leaves it cheap: 2.048 µs of 100 µs
    slow = pd_estimate(2048, 100e-6, STALLS, replace(T, link_bandwidth_bytes_per_second=1e9))
    assert slow.figures["transfer_share"] == pytest.approx(0.02048)
    # no interference to remove: the estimate says no however cheap the transfer
    assert pd_estimate(2048, 100e-6, head_of_line(Gaps(0.1, 0.1, 60, 60, 1024), T), T).answer == Answer.NO
    assert pd_estimate(None, 100e-6, STALLS, T).answer == Answer.NOT_ENOUGH_DATA


# ---- prefix hits and the whole report --------------------------------------------------------


def test_prefix_hits_per_length_bucket() -> None:
    hits = prefix_hits_by_bucket(requests([100, 100, 4000, 50_000, 60], [50, 0, 3000, 49_000, None]))
    values = dict(zip(hits["labels"], hits["values"], strict=True))
    assert values["<=512"] == pytest.approx(50 / 200)
    assert values["<=8K"] == pytest.approx(0.75)
    assert values[">32K"] == pytest.approx(0.98)
    assert values["<=2K"] is None
    assert hits["num_requests_with_cached_tokens"] == 4


def test_report_has_tuning_only_on_chunked_pools() -> None:
    mono = advise(inputs(profile=Profile("monolithic", 8192, 8192, 8)), T)
    assert mono.tuning == []
    chunked = advise(inputs(profile=Profile("chunked", 512, 512, 8)), T)
    assert [f.key for f in chunked.tuning] == ["chunk_too_small", "budget_too_large", "long_starved", "short_starved"]
    body = chunked.to_json()
    assert body["overall"] == "not_worth_it"
    assert {q["key"] for q in body["questions"]} == {"long_tail", "concurrency", "memory"}
