"""The advisor's verdicts on constructed figures, as tables: each question yes,
no and not-enough-data, with the boundaries; the decode-stall evidence and the
decision table; what "long" is relative to the model and pool; the knobs from
step time; the tuning findings; the PD estimate against a hand computation;
the thresholds table. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace

import pytest

from controlplane.advisor.verdicts import (
    DECISION_TABLE,
    FIGURE_UNITS,
    THRESHOLDS,
    Answer,
    Decode,
    Engine,
    Finding,
    Gaps,
    Inputs,
    Overall,
    Profile,
    Questions,
    Requests,
    Samples,
    Stall,
    Thresholds,
    Throughput,
    advise,
    budget_too_large,
    chunk_too_small,
    concurrency,
    knobs,
    kv_bytes_per_token,
    long_prompt,
    long_starved,
    long_tail,
    memory,
    overall,
    pd_estimate,
    prefix_hits_by_bucket,
    prevented,
    rule_for,
    short_starved,
    stalls,
)
from workers.engines.reference.tiny import MODEL_CONFIG as TINY_CONFIG

T = Thresholds(min_requests=100, min_samples=20, min_gaps=50)
NAN = math.nan


def requests(
    lengths: Sequence[int | None], cached: list[int | None] | None = None, ok: list[bool] | None = None
) -> Requests:
    n = len(lengths)
    return Requests(
        lengths,
        cached if cached is not None else [None] * n,
        [float(i) for i in range(n)],
        [0.1] * n,
        ok if ok is not None else [True] * n,
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
TBT = 0.1
OBJECTIVE = Decode(tbt_objective_seconds=TBT)


def inputs(**changes: object) -> Inputs:
    base = Inputs(requests([100] * 200), samples(100), None, 0.0, 1.0, NO_GAPS, ENGINE, None, decode=OBJECTIVE)
    return replace(base, **changes)  # type: ignore[arg-type]


def model(max_model_len: int, *, spt: float | None = None) -> Engine:
    return Engine(None, None, None, None, spt, max_model_len=max_model_len)


# ---- what is long: relative to the model and the pool ----------------------------


@pytest.mark.parametrize(
    ("case", "tokens", "why"),
    [
        # a quarter of the context
        (inputs(engine=model(4096)), 1024, "fills more than 25% of the 4,096-token context"),
        (inputs(engine=model(131_072)), 32_768, "131,072-token context"),
        # a prefill that alone takes longer than the TBT objective: 0.1 s / 200 µs = 500 tokens
        (inputs(engine=model(131_072, spt=200e-6)), 500, "(200 µs per token) would take longer than the TBT"),
        # on a chunked pool, more than 4 chunk caps of 128
        (inputs(engine=model(4096), profile=Profile("chunked", 256, 128, 8)), 512, "more than 4 chunk caps of 128"),
        # a monolithic pool's cap does not count
        (inputs(engine=model(4096), profile=Profile("monolithic", 256, 128, 8)), 1024, "context"),
        (inputs(), None, "No max_model_len"),
    ],
)
def test_long_prompt_is_relative_to_the_model_and_pool(case: Inputs, tokens: int | None, why: str) -> None:
    long = long_prompt(case, T)
    assert long.tokens == tokens
    assert why in long.basis


# ---- long tail ----------------------------------------------------------------

LONG_8K = long_prompt(inputs(engine=model(32_768)), T)  # 8,192 tokens
LONG_4K_MODEL = long_prompt(inputs(engine=model(4096)), T)  # 1,024 tokens


@pytest.mark.parametrize(
    ("lengths", "long", "answer", "why"),
    [
        ([100] * 99, LONG_8K, Answer.NOT_ENOUGH_DATA, "Only 99 requests"),
        ([], LONG_8K, Answer.NOT_ENOUGH_DATA, "Only 0 requests"),
        ([100] * 200, LONG_8K, Answer.NO, "no long tail"),
        # 5% over 8K exactly: at the threshold is yes
        ([100] * 95 + [9000] * 5, LONG_8K, Answer.YES, "5.0% of prompts are over 8,192"),
        # 4%: the share says no; P99 lands in the long prompts: the ratio says yes
        ([100] * 96 + [9000] * 4, LONG_8K, Answer.YES, "the median"),
        # 8192 itself is not over the threshold; P99/P50 = 8192/1024 = 8: yes by the ratio, exactly at it
        ([1024] * 90 + [8192] * 10, LONG_8K, Answer.YES, "8.0× the median"),
        # just under the ratio and no prompt over 8K
        ([1024] * 90 + [8000] * 10, LONG_8K, Answer.NO, "no long tail"),
        # a 4,096-token model: no prompt can pass 8K, yet 5% over 1,024 is a long tail
        ([400] * 95 + [3000] * 5, LONG_4K_MODEL, Answer.YES, "5.0% of prompts are over 1,024"),
        ([400] * 96 + [1000] * 4, LONG_4K_MODEL, Answer.NO, "no long tail"),
        # refused requests have no length: they are not 0-token prompts (and not counted)
        ([100] * 99 + [None] * 50, LONG_8K, Answer.NOT_ENOUGH_DATA, "Only 99 requests"),
    ],
)
def test_long_tail(lengths: list[int | None], long, answer: Answer, why: str) -> None:
    finding = long_tail(requests(lengths), long, T)
    assert finding.answer == answer
    assert why in " ".join(finding.reasons)
    known = [n for n in lengths if n is not None]
    assert finding.num_samples == len(known)
    assert sum(finding.chart["values"]) == len(known)


def test_long_tail_without_anything_to_judge_length_by_is_not_enough_data() -> None:
    finding = long_tail(requests([100] * 200), long_prompt(inputs(), T), T)
    assert finding.answer == Answer.NOT_ENOUGH_DATA
    assert "No max_model_len" in finding.reasons[0]


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


def test_past_ten_minutes_the_count_says_minute_samples() -> None:
    minutes = replace(samples(10), unit="minute samples")
    for finding in (concurrency(inputs(samples=minutes), T), memory(inputs(samples=minutes), T)):
        assert finding.answer == Answer.NOT_ENOUGH_DATA
        assert finding.reasons[0].startswith("Only 10 minute samples")
        assert finding.num_samples == 10
    assert "scrapes" in concurrency(inputs(samples=samples(10)), T).reasons[0]


# ---- the decode-stall evidence -----------------------------------------------------------

D = Decode  # (TBT objective, stall P99, requests behind it, decode step)


@pytest.mark.parametrize(
    ("gaps", "decode", "stall", "answer", "why"),
    [
        # long prefills push the gap P99 past the 100-ms objective, with 50 gaps: yes
        (Gaps(0.4, 0.02, 50, 500, 256), D(TBT, 0.4, 200), Stall.LONG_PREFILL, Answer.YES, "past the TBT objective"),
        # 49 gaps are too few, and too few other gaps to say the stalls are theirs: unknown
        (Gaps(0.4, 0.02, 49, 49, 256), D(TBT, 0.4, 200), Stall.UNKNOWN, Answer.NOT_ENOUGH_DATA, "too few gaps"),
        # 21 gaps (a long prefill makes one per request decoding beside it), but the requests' largest gaps
        # break the objective while 4,500 other gaps stay inside it: the stalls are the long prefills'
        (Gaps(1.08, 0.05, 21, 4500, 512), D(TBT, 1.08, 100), Stall.LONG_PREFILL, Answer.YES, "Under 50 such gaps"),
        # ... not when the requests' largest gaps stay inside the objective
        (Gaps(1.08, 0.05, 21, 4500, 512), D(TBT, 0.09, 100), Stall.NONE, Answer.NO, "No stall breaks"),
        # exactly at the objective is not past it
        (Gaps(0.1, 0.02, 500, 500, 256), D(TBT, 0.1, 200), Stall.NONE, Answer.NO, "No stall breaks"),
        # a 1.992× ratio with every gap inside the objective: no stall, whatever the ratio
        (Gaps(0.0498, 0.025, 500, 500, 256), D(TBT, 0.05, 200), Stall.NONE, Answer.NO, "No stall breaks"),
        # the gaps without long prefills miss the objective too: chunking cannot meet it
        (Gaps(0.3, 0.2, 500, 500, 256), D(TBT, 0.3, 200), Stall.OTHER, Answer.NO, "cannot meet it."),
        # ... even when long prefills make it 2× worse (said, as what chunking would still ease)
        (Gaps(0.4, 0.2, 500, 500, 256), D(TBT, 0.4, 200), Stall.OTHER, Answer.NO, "make it 2.0× worse"),
        # the reduced panel's short prompts on a loaded CPU: 332 ms during prefills, 142 ms otherwise
        (Gaps(0.332, 0.142, 165, 2000, 128), D(TBT, 0.443, 90), Stall.OTHER, Answer.NO, "142 ms then"),
        # just inside the objective otherwise: the long prefills are what push it past
        (Gaps(0.4, 0.1, 500, 500, 256), D(TBT, 0.4, 200), Stall.LONG_PREFILL, Answer.YES, "past the TBT"),
        # no long prefill ever ran, the other gaps miss the objective
        (Gaps(None, 0.2, 0, 500, 256), D(TBT, 0.3, 200), Stall.OTHER, Answer.NO, "no long prefill runs"),
        # no long prefill ever ran and nothing misses: no (short prompts at a low rate)
        (Gaps(None, 0.01, 0, 500, 256), D(TBT, 0.02, 200), Stall.NONE, Answer.NO, "No stall breaks"),
        # only the requests' largest gaps are known: enough requests, inside the objective
        (Gaps(None, None, 0, 0, 256), D(TBT, 0.05, 100), Stall.NONE, Answer.NO, "No stall breaks"),
        (Gaps(None, None, 0, 0, 256), D(TBT, 0.05, 99), Stall.UNKNOWN, Answer.NOT_ENOUGH_DATA, "needs 50 gaps"),
        # stalls past the objective with no long prefill at all: not chunking's to fix
        (Gaps(None, None, 0, 0, 256), D(TBT, 0.5, 100), Stall.OTHER, Answer.NO, "not while long prefills run"),
        # no objective: nothing to judge against
        (Gaps(0.4, 0.02, 500, 500, 256), D(None, 0.4, 200), Stall.UNKNOWN, Answer.NOT_ENOUGH_DATA, "No TBT"),
    ],
)
def test_stalls_against_the_tbt_objective(gaps: Gaps, decode: Decode, stall: Stall, answer: Answer, why: str) -> None:
    got, finding = stalls(gaps, decode, T)
    assert (got, finding.answer) == (stall, answer)
    assert why in finding.reasons[0]
    assert finding.figures["tbt_objective_seconds"] == decode.tbt_objective_seconds


def test_stalls_say_when_they_are_approximate() -> None:
    _, finding = stalls(Gaps(0.5, 0.01, 60, 60, 1024, approximate=True), OBJECTIVE, T)
    assert finding.approximate
    assert "approximate" in finding.reasons[0]


# ---- the overall verdict: the decision table --------------------------------------------------


def q(answer: Answer) -> Finding:
    return Finding("q", "Q?", answer, 10, {}, {}, [f"because {answer.value}"])


Y, N, U = Answer.YES, Answer.NO, Answer.NOT_ENOUGH_DATA
HOL = {
    Stall.LONG_PREFILL: stalls(Gaps(0.4, 0.02, 500, 500, 256), D(TBT, 0.4, 200), T)[1],
    Stall.OTHER: stalls(Gaps(0.3, 0.2, 500, 500, 256), D(TBT, 0.3, 200), T)[1],
    Stall.NONE: stalls(Gaps(0.05, 0.02, 500, 500, 256), D(TBT, 0.05, 200), T)[1],
    Stall.UNKNOWN: stalls(NO_GAPS, OBJECTIVE, T)[1],
}


def test_every_case_matches_exactly_one_row_of_the_decision_table() -> None:
    for stall in Stall:
        for said in Questions:
            rows = [r for r in DECISION_TABLE if stall in r.stalls and said in r.questions]
            assert len(rows) == 1, (stall, said)


@pytest.mark.parametrize(
    ("stall", "answers", "verdict"),
    [
        # long prefills past the objective: worth it whatever the three questions say
        (Stall.LONG_PREFILL, (N, N, N), Overall.WORTH_IT),
        (Stall.LONG_PREFILL, (U, U, U), Overall.WORTH_IT),
        (Stall.LONG_PREFILL, (Y, Y, N), Overall.WORTH_IT),
        # no stall: two of three decide
        (Stall.NONE, (Y, Y, Y), Overall.WORTH_IT),
        (Stall.NONE, (Y, N, Y), Overall.WORTH_IT),
        (Stall.NONE, (U, Y, Y), Overall.WORTH_IT),
        (Stall.NONE, (Y, N, N), Overall.NOT_WORTH_IT),
        (Stall.NONE, (N, N, N), Overall.NOT_WORTH_IT),
        (Stall.NONE, (U, N, N), Overall.NOT_WORTH_IT),
        (Stall.NONE, (Y, U, N), Overall.NOT_ENOUGH_DATA),  # the unknown one could make it two
        (Stall.NONE, (U, U, U), Overall.NOT_ENOUGH_DATA),
        # stalls from something else: never "not worth it"
        (Stall.OTHER, (N, N, N), Overall.OTHER_CAUSE),
        (Stall.OTHER, (Y, U, N), Overall.OTHER_CAUSE),
        (Stall.OTHER, (Y, Y, N), Overall.WORTH_IT),
        # no stall evidence: "not worth it" is never said without it
        (Stall.UNKNOWN, (N, N, N), Overall.NOT_ENOUGH_DATA),
        (Stall.UNKNOWN, (Y, Y, N), Overall.WORTH_IT),
    ],
)
def test_overall_comes_from_the_decision_table(stall: Stall, answers: tuple[Answer, ...], verdict: Overall) -> None:
    result, reasons, rule = overall([q(a) for a in answers], HOL[stall], stall)
    assert result == verdict == DECISION_TABLE[rule].overall
    assert reasons[0] == DECISION_TABLE[rule].why
    # the headline never contradicts a finding without saying why: each one that disagrees is named
    for a in answers:
        if (a == Y) != (verdict == Overall.WORTH_IT) and a != U:
            assert f"because {a.value}" in " ".join(reasons)
    hol = HOL[stall]
    if hol.answer != U and (hol.answer == Y) != (verdict == Overall.WORTH_IT):
        assert hol.reasons[0] in " ".join(reasons)


def test_the_issues_case_stalls_49x_yet_three_noes_is_worth_it() -> None:
    # the decode gap P99 during long prefills 6.3 s against a 100-ms objective; the questions all say no
    case = inputs(gaps=Gaps(6.3, 0.02, 400, 5000, 256), decode=D(TBT, 6.3, 820))
    report = advise(case, T)
    assert report.overall == Overall.WORTH_IT
    assert report.head_of_line.answer == Answer.YES
    assert rule_for(Stall.LONG_PREFILL, Questions.NO) == report.rule


# ---- a chunked pool whose chunking is what keeps long prefills off the decodes --------------

TUNED = Profile("chunked", 256, 128, 32)
SLOW = Engine(None, None, None, None, 329e-6, max_model_len=2048)  # 250 ms / 329 µs = 759 tokens whole


def traffic(num_long: int, num_short: int = 100, *, long_tokens: int = 1700, refused: int = 0) -> Requests:
    lengths: list[int | None] = [long_tokens] * num_long + [100] * num_short + [None] * refused
    ok = [True] * (num_long + num_short) + [False] * refused
    return requests(lengths, None, ok)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        # 15 of 115 prompts (13%) would each take 0.56 s whole against a 250-ms objective
        (inputs(profile=TUNED, engine=SLOW, requests=traffic(15)), "15 of its 115 prompts (13.0%)"),
        # exactly 1% (1 of 100) is not past the P99; 2 of 101 is
        (inputs(profile=TUNED, engine=SLOW, requests=traffic(1, 99)), ""),
        (inputs(profile=TUNED, engine=SLOW, requests=traffic(2, 99)), "2 of its 101 prompts"),
        # prompts short enough to prefill whole inside the objective
        (inputs(profile=TUNED, engine=SLOW, requests=traffic(15, long_tokens=700)), ""),
        # refused requests are not prompts: 2 of 101, not of 151
        (inputs(profile=TUNED, engine=SLOW, requests=traffic(2, 99, refused=50)), "2 of its 101 prompts"),
        # monolithic, a budget that never splits, no long prefill beside decodes, no prefill time: not this
        (inputs(profile=Profile("monolithic", 2048, 2048, 32), engine=SLOW, requests=traffic(15)), ""),
        (inputs(profile=Profile("chunked", 2048, 2048, 32), engine=SLOW, requests=traffic(15)), ""),
        (inputs(profile=TUNED, engine=replace(SLOW, prefill_seconds_per_token=None), requests=traffic(15)), ""),
    ],
)
def test_prevented_on_a_chunked_pool_that_splits(case: Inputs, says: str) -> None:
    case = replace(case, gaps=Gaps(0.1, 0.05, 60, 4000, 128), decode=D(0.25, 0.2, 115))
    assert (says in prevented(case, T)) if says else prevented(case, T) == ""
    assert prevented(replace(case, gaps=Gaps(None, 0.05, 0, 4000, 128)), T) == ""


def test_a_tuned_chunked_pool_just_past_the_objective_is_worth_keeping() -> None:
    # the A/B panel's tuned-chunked row: stall P99 252 ms against 250, not during long prefills; monolithic
    # on the same traffic stalled 1.2 s
    case = inputs(
        profile=TUNED,
        engine=SLOW,
        requests=traffic(15),
        gaps=Gaps(0.2, 0.1, 60, 4000, 128),
        decode=D(0.25, 0.252, 115),
    )
    report = advise(case, T)
    assert report.head_of_line.answer == Answer.NO and "not while long prefills run" in report.head_of_line.reasons[0]
    assert report.stall == Stall.PREVENTED and report.overall == Overall.WORTH_IT
    assert report.overall_reasons[0] == DECISION_TABLE[report.rule].why
    assert "15 of its 115 prompts" in report.overall_reasons[1]
    # the finding it seems to contradict is named beside the headline
    assert report.head_of_line.reasons[0] in " ".join(report.overall_reasons)


# ---- starting knobs: Sarathi-Serve's rule ------------------------------------------------------

GIB = 2**30


def test_knobs_from_step_time_fit_the_tbt_objective() -> None:
    # (100 ms − 10 ms decode step) / 100 µs per prefill token = 900 tokens → 896 (block 16)
    engine = Engine(None, None, None, None, 100e-6, max_model_len=4096)
    running = replace(samples(100), running=[float(i % 10) for i in range(100)])  # P90 = 8.1 → 9 decodes
    case = inputs(
        engine=engine, samples=running, decode=D(TBT, None, 0, 0.010), profile=Profile("chunked", 8192, 8192, 32)
    )
    k = knobs(case, T)
    assert k.max_num_batched_tokens == 896
    assert k.chunk_tokens == 896 - 9
    assert "fits the TBT objective" in k.reasons[0]
    # the step a full budget implies fits the objective
    assert 100e-6 * k.max_num_batched_tokens + 0.010 <= TBT


def test_knobs_bounded_by_memory_then_strictly_below_the_context() -> None:
    # the step allows 8,992 tokens; memory (0.33 × 64 GiB / 4 MiB = 5,406 → 5,392) is tighter; the context tighter still
    engine = Engine(80 * GIB, 16 * GIB, 4 * 2**20, None, 10e-6, max_model_len=4096)
    case = inputs(engine=engine, samples=samples(100, running=8), decode=D(TBT, None, 0, 0.010))
    k = knobs(case, T)
    assert k.chunk_tokens_high == 5392
    assert k.max_num_batched_tokens == 4096 - 16  # strictly below max_model_len: the longest prompt splits
    assert k.chunk_tokens == 4080 - 8
    assert any("strictly below the 4,096-token context" in r for r in k.reasons)
    # without the context bound, memory caps the chunk
    wide = knobs(replace(case, engine=replace(engine, max_model_len=131_072)), T)
    assert wide.chunk_tokens == 5392 and wide.max_num_batched_tokens == 5392 + 8


def test_knobs_from_memory_alone_when_step_times_are_unknown() -> None:
    engine = Engine(80 * GIB, 16 * GIB, 4 * 2**20, None, None, max_model_len=32_768)
    profile = Profile("monolithic", 8192, 8192, max_num_seqs=64, block_size=16)
    lengths = [100] * 50 + [300] * 50 + [20_000] * 10
    k = knobs(
        inputs(engine=engine, profile=profile, samples=samples(100, running=4), requests=requests(lengths, [0] * 110)),
        T,
    )
    assert "No step-time rule" in k.reasons[0]
    # (80 − 16) GiB × ¼ / 4 MiB = 4096 tokens; × 0.33 = 5406 → 5392 (a multiple of the block size)
    assert (k.chunk_tokens, k.chunk_tokens_high) == (4096, 5392)
    assert k.max_num_batched_tokens == 4096 + 4  # one chunk beside the P90 of running decodes
    assert k.short_prompt_threshold == 304  # median 300, rounded up to the block size


def test_a_decode_step_over_the_objective_leaves_no_budget() -> None:
    case = inputs(engine=Engine(None, None, None, None, 100e-6, max_model_len=4096), decode=D(TBT, None, 0, 0.2))
    k = knobs(case, T)
    assert k.max_num_batched_tokens is None and "no budget fits" in k.reasons[0]


def test_short_prompt_threshold_from_successful_requests_only() -> None:
    # 60 successful prompts of 734 tokens; 40 refused (429) with no length: they are not 0-token prompts
    lengths: list[int | None] = [734] * 60 + [None] * 40
    ok = [True] * 60 + [False] * 40
    k = knobs(inputs(requests=requests(lengths, [0] * 60 + [None] * 40, ok)), T)
    assert k.figures["median_tokens_to_compute"] == 734
    assert k.short_prompt_threshold == 736
    # failed requests with a length do not count either
    k = knobs(inputs(requests=requests([734] * 60 + [10] * 40, None, ok)), T)
    assert k.short_prompt_threshold == 736


def test_short_prompt_threshold_counts_tokens_left_after_the_prefix_hit() -> None:
    # long prompts whose cached prefixes leave 96 tokens each: they are short prefills
    k = knobs(inputs(requests=requests([100_000] * 10, [99_904] * 10)), T)
    assert k.short_prompt_threshold == 96
    assert k.chunk_tokens is None  # no step times and no memory facts from the workers
    assert "do not report" in k.reasons[1]


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


MONO_BASE = pool(100, 1.0, mode="monolithic", name="mono")
STEP = D(TBT, None, 0, 0.010)  # a 10-ms decode step


@pytest.mark.parametrize(
    ("profile", "engine", "decode", "stall", "answer", "why"),
    [
        # an 8,192 budget on a 4,096-token model never splits anything: not chunking
        (Profile("chunked", 8192, 8192, 16), model(4096), OBJECTIVE, Stall.UNKNOWN, Answer.YES, "Not chunking"),
        (Profile("chunked", 4096, 4096, 16), model(4096), OBJECTIVE, Stall.NONE, Answer.YES, "ever split"),
        # the 512/256 profile: 100 µs × 512 + 10 ms = 61 ms fits 100 ms, whatever the HOL ratio (1.992×)
        (Profile("chunked", 512, 256, 16), model(4096, spt=100e-6), STEP, Stall.NONE, Answer.NO, "the budget fits"),
        # 2,048 tokens: 100 µs × 2048 + 10 ms = 215 ms, past the objective
        (
            Profile("chunked", 2048, 2048, 16),
            model(4096, spt=100e-6),
            STEP,
            Stall.NONE,
            Answer.YES,
            "stalls the decodes",
        ),
        # exactly at the objective: 100 µs × 900 + 10 ms = 100 ms fits
        (Profile("chunked", 900, 900, 16), model(4096, spt=100e-6), STEP, Stall.NONE, Answer.NO, "the budget fits"),
        # no step times: the stall evidence decides
        (Profile("chunked", 2048, 2048, 16), model(4096), OBJECTIVE, Stall.LONG_PREFILL, Answer.YES, "still push"),
        (Profile("chunked", 2048, 2048, 16), model(4096), OBJECTIVE, Stall.NONE, Answer.NO, "do not push"),
        (Profile("chunked", 2048, 2048, 16), model(4096), OBJECTIVE, Stall.UNKNOWN, Answer.NOT_ENOUGH_DATA, "too few"),
    ],
)
def test_budget_too_large(
    profile: Profile, engine: Engine, decode: Decode, stall: Stall, answer: Answer, why: str
) -> None:
    case = inputs(profile=profile, engine=engine, decode=decode)
    finding = budget_too_large(case, stall, knobs(case, T), T)
    assert finding.answer == answer
    assert why in finding.reasons[0]
    if answer == Answer.YES:
        assert (finding.knob, finding.direction) == ("max_num_batched_tokens", "lower")
    # judged on the pool alone: a monolithic pool beside it in the routing table changes nothing
    beside = replace(case, pool=pool(100, 0.5), baseline=MONO_BASE)
    assert budget_too_large(beside, stall, knobs(beside, T), T).answer == answer


def log(rows: list[tuple[float, int, float]]) -> Requests:
    """(arrival, prompt tokens, TTFT) rows, all successful."""
    return Requests(
        [r[1] for r in rows], [None] * len(rows), [r[0] for r in rows], [r[2] for r in rows], [True] * len(rows)
    )


def test_starvation_of_long_prompts_names_min_prefill_tokens() -> None:
    # short ones: 100 tokens in 0.01 s (1e-4 s/token); long ones 10K tokens in 4 s (4e-4 s/token): 4×
    rows = [(float(i), 100, 0.01) for i in range(100)] + [(100.0 + i * 10, 10_000, 4.0) for i in range(5)]
    finding = long_starved(log(rows), LONG_8K, T)
    assert finding.answer == Answer.YES
    assert (finding.knob, finding.direction) == ("min_prefill_tokens_per_step", "raise")
    rows = [(float(i), 100, 0.01) for i in range(100)] + [(100.0 + i * 10, 10_000, 2.0) for i in range(5)]
    assert long_starved(log(rows), LONG_8K, T).answer == Answer.NO  # 2× < 3×


def test_starvation_is_relative_to_the_model() -> None:
    # a 4,096-token model: 3,000-token prompts are long there (over 1,024), never over an absolute 8K
    rows = [(float(i), 100, 0.01) for i in range(100)] + [(100.0 + i * 10, 3000, 1.2) for i in range(5)]
    assert long_starved(log(rows), LONG_4K_MODEL, T).answer == Answer.YES
    assert long_starved(log(rows), LONG_8K, T).answer == Answer.NOT_ENOUGH_DATA


def test_starvation_of_short_prompts_during_long_prefills() -> None:
    # a long prompt arrives at 0 and gets its first token at 10; short ones inside that wait 0.5 s, others 0.05 s
    rows = [(0.0, 20_000, 10.0)] + [(0.5 + i * 0.5, 100, 0.5) for i in range(19)]
    rows += [(20.0 + i, 100, 0.05) for i in range(100)]
    finding = short_starved(log(rows), LONG_8K, T)
    assert finding.answer == Answer.YES
    assert (finding.knob, finding.direction) == ("long_prefill_token_threshold", "lower")
    assert finding.figures["ratio"] == pytest.approx(10.0)


def test_starvation_without_long_prompts_is_not_enough_data() -> None:
    rows = log([(float(i), 100, 0.01) for i in range(200)])
    assert [f(rows, LONG_8K, T).answer for f in (long_starved, short_starved)] == [Answer.NOT_ENOUGH_DATA] * 2


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
STALLS = stalls(Gaps(0.5, 0.1, 60, 60, 1024), Decode(0.1), T)[1]


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
    slow = pd_estimate(2048, 100e-6, STALLS, replace(T, link_bandwidth_gbps=1.0))
    assert slow.figures["transfer_share"] == pytest.approx(0.02048)
    # no interference to remove: the estimate says no however cheap the transfer
    assert pd_estimate(2048, 100e-6, stalls(Gaps(0.05, 0.05, 60, 60, 1024), Decode(0.1), T)[1], T).answer == Answer.NO
    assert pd_estimate(None, 100e-6, STALLS, T).answer == Answer.NOT_ENOUGH_DATA


# ---- prefix hits, the thresholds table and the whole report ----------------------------------


def test_prefix_hits_per_length_bucket() -> None:
    hits = prefix_hits_by_bucket(requests([100, 100, 4000, 50_000, 60], [50, 0, 3000, 49_000, None]))
    values = dict(zip(hits["labels"], hits["values"], strict=True))
    assert values["<=512"] == pytest.approx(50 / 200)
    assert values["<=8K"] == pytest.approx(0.75)
    assert values[">32K"] == pytest.approx(0.98)
    assert values["<=2K"] is None
    assert hits["num_requests_with_cached_tokens"] == 4


def test_thresholds_are_one_table_with_a_unit_and_meaning_each() -> None:
    assert [row.field for row in THRESHOLDS] == [f.name for f in fields(Thresholds)]
    for row in THRESHOLDS:
        assert row.unit and row.meaning, row.field
        assert getattr(Thresholds(), row.field) == row.default


def rich_inputs(profile: Profile) -> Inputs:
    engine = Engine(80 * GIB, 16 * GIB, 4 * 2**20, 131072, 100e-6, max_model_len=4096)
    lengths: list[int | None] = [100] * 150 + [3000] * 20 + [None] * 5
    timed = Requests(
        lengths, [0] * 175, [float(i) for i in range(175)], [0.05] * 150 + [2.0] * 25, [True] * 170 + [False] * 5
    )
    return inputs(
        requests=timed,
        engine=engine,
        profile=profile,
        gaps=Gaps(0.4, 0.02, 500, 500, 256),
        decode=D(TBT, 0.4, 170, 0.01),
        pool=pool(80, 0.1),
        baseline=MONO_BASE,
    )


def test_every_figure_a_report_shows_has_a_unit() -> None:
    body = advise(rich_inputs(Profile("chunked", 512, 256, 16)), T).to_json()
    answers = [*body["questions"], body["head_of_line"], *body["tuning"], body["pd"]]
    named = {k for a in answers for k in a["figures"]} | set(body["knobs"]["figures"])
    assert named <= set(FIGURE_UNITS), named - set(FIGURE_UNITS)
    assert {k for a in answers for k in a["thresholds"]} <= {row.field for row in THRESHOLDS}


def test_report_has_tuning_only_on_chunked_pools() -> None:
    mono = advise(inputs(profile=Profile("monolithic", 8192, 8192, 8)), T)
    assert mono.tuning == []
    chunked = advise(inputs(profile=Profile("chunked", 512, 512, 8)), T)
    assert [f.key for f in chunked.tuning] == ["chunk_too_small", "budget_too_large", "long_starved", "short_starved"]
    body = chunked.to_json()
    # 200 short requests, nothing stalls past the objective (no gaps, no stall P99): no verdict without evidence
    assert body["overall"] == "not_enough_data"
    assert body["decision"]["table"][body["decision"]["rule"]]["overall"] == "not_enough_data"
    assert {q["key"] for q in body["questions"]} == {"long_tail", "concurrency", "memory"}
    quiet = advise(inputs(profile=Profile("chunked", 512, 512, 8), decode=D(TBT, 0.02, 200)), T)
    assert quiet.overall == Overall.NOT_WORTH_IT
