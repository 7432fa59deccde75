"""The advisor's answers: does this traffic need chunked prefill, with which
knobs, and is a chunked pool tuned right. Pure: dataclasses in and out, no
Django, no I/O (``inputs.py`` gathers the facts from live figures).

Design note. Three questions decide whether chunked prefill is likely worth
it, each answered yes, no or not enough data (with its sample count):

* long tail — is the prompt-length distribution long-tailed (share of
  prompts over ``long_prompt_tokens``, P99/P50 of length)?
* concurrency held back — do requests wait while the engine runs at
  ``max_num_seqs`` or with its KV cache nearly full (share of scrapes), and
  does the queue show it (queue P99, preemptions)?
* memory peak caps the batch — is the memory peak far above its mean, with
  the KV cache full at the peaks or preemptions while long prefills run?

Two yes answers: "likely worth it". Head-of-line blocking is the evidence
that chunking has a target: for requests already decoding, the P99 gap
between tokens while a prefill of more than N tokens runs against the P99 gap
while none does. Then the starting knobs (``knobs``), the findings on a
chunked pool (``tuning``) and the prefill-decode disaggregation estimate
(``pd_estimate``), each with the figures and threshold behind it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from workers.figures import PROMPT_BUCKETS, percentile, prompt_bucket


class Answer(StrEnum):
    YES = "yes"
    NO = "no"
    NOT_ENOUGH_DATA = "not_enough_data"


class Overall(StrEnum):
    WORTH_IT = "worth_it"
    NOT_WORTH_IT = "not_worth_it"
    NOT_ENOUGH_DATA = "not_enough_data"


@dataclass(frozen=True)
class Thresholds:
    """Every threshold an answer uses; ``conf.py`` makes each one a tunable."""

    min_requests: int = 100
    min_samples: int = 20
    min_gaps: int = 50
    long_prompt_tokens: int = 8192
    long_tail_share: float = 0.05
    long_tail_p99_over_p50: float = 8.0
    saturated_share: float = 0.10
    kv_nearly_full: float = 0.90
    queue_p99_seconds: float = 1.0
    memory_peak_to_mean: float = 1.5
    hol_ratio: float = 2.0
    chunk_too_small_throughput_drop: float = 0.15
    budget_min_stall_gain: float = 2.0
    starvation_ratio: float = 3.0
    activation_share_low: float = 0.25
    activation_share_high: float = 1 / 3
    link_bandwidth_bytes_per_second: float = 25e9
    pd_max_transfer_share: float = 0.5


@dataclass(frozen=True)
class Finding:
    """One answer: the verdict, the figures behind it, the threshold used, and
    the reasons as sentences. ``knob``/``direction`` only on tuning findings."""

    key: str
    title: str
    answer: Answer
    num_samples: int
    figures: dict[str, float | None]
    thresholds: dict[str, float]
    reasons: list[str]
    chart: dict[str, Any] = field(default_factory=dict)
    knob: str = ""
    direction: str = ""  # "raise" or "lower"
    approximate: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["answer"] = self.answer.value
        return out


# ---- inputs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """The gateway's log rows of the window (successful or not), in arrival order."""

    prompt_tokens: Sequence[int]
    cached_tokens: Sequence[int | None]  # None: the gateway did not learn it
    created: Sequence[float]  # epoch seconds
    ttft_seconds: Sequence[float | None]
    ok: Sequence[bool]


@dataclass(frozen=True)
class Samples:
    """One row per kept scrape of every worker in the group, each worker's rows
    consecutive and in time order. Deltas are since the worker's previous row
    (NaN for its first)."""

    worker: Sequence[int]
    waiting: Sequence[float]
    running: Sequence[float]
    kv_usage: Sequence[float]
    max_num_seqs: Sequence[float]  # what the worker's profile allowed then; NaN: unknown
    memory_peak_bytes: Sequence[float]
    preemptions_delta: Sequence[float]
    long_prefill_steps_delta: Sequence[float]


@dataclass(frozen=True)
class Gaps:
    """Gaps between tokens of requests already decoding, split by whether a
    prefill of more than ``long_prefill_tokens`` ran during the gap."""

    long_prefill_p99_seconds: float | None
    other_p99_seconds: float | None
    num_long_prefill: int
    num_other: int
    long_prefill_tokens: int
    approximate: bool = False  # from per-request stats (the gateway log), not per-step records


@dataclass(frozen=True)
class Profile:
    """The knobs a pool runs (``EngineProfile``'s names)."""

    prefill_mode: str
    max_num_batched_tokens: int
    chunk_cap: int
    max_num_seqs: int
    block_size: int = 16
    short_prompt_threshold: int | None = None
    min_prefill_tokens_per_step: int | None = None


@dataclass(frozen=True)
class Engine:
    """What the workers say about their memory and speed."""

    device_memory_bytes: float | None
    weight_bytes: float | None
    activation_bytes_per_token: float | None  # prefill step's transient peak per token
    kv_bytes_per_token: float | None
    prefill_seconds_per_token: float | None
    max_model_len: int | None = None
    device: str = ""


@dataclass(frozen=True)
class Throughput:
    """A pool's (or its baseline's) figures for the tuning findings."""

    output_tokens_per_second_per_worker: float | None
    stall_p99_seconds: float | None
    num_requests: int
    prefill_mode: str = ""
    name: str = ""


@dataclass(frozen=True)
class Inputs:
    requests: Requests
    samples: Samples
    queue_p99_seconds: float | None
    num_preemptions: float | None
    memory_peak_to_mean: float | None
    gaps: Gaps
    engine: Engine
    profile: Profile | None
    pool: Throughput | None = None
    baseline: Throughput | None = None


# ---- the three questions -----------------------------------------------------------


def _length_histogram(lengths: np.ndarray) -> dict[str, Any]:
    labels = [name for name, _ in PROMPT_BUCKETS]
    counts = dict.fromkeys(labels, 0)
    for n in lengths.tolist():
        counts[prompt_bucket(int(n))] += 1
    return {"kind": "bar", "labels": labels, "values": [counts[label] for label in labels], "unit": "requests"}


def long_tail(requests: Requests, t: Thresholds) -> Finding:
    lengths = np.asarray(requests.prompt_tokens, dtype=np.float64)
    n = len(lengths)
    p50 = percentile(lengths.tolist(), 50)
    p99 = percentile(lengths.tolist(), 99)
    share = float((lengths > t.long_prompt_tokens).mean()) if n else None
    ratio = p99 / p50 if p50 and p99 is not None else None
    figures = {"share_over_long": share, "p50_tokens": p50, "p99_tokens": p99, "p99_over_p50": ratio}
    thresholds = {
        "long_prompt_tokens": t.long_prompt_tokens,
        "long_tail_share": t.long_tail_share,
        "long_tail_p99_over_p50": t.long_tail_p99_over_p50,
        "min_requests": t.min_requests,
    }
    chart = _length_histogram(lengths)
    title = "Is the prompt-length distribution long-tailed?"
    if n < t.min_requests or share is None:
        return Finding(
            "long_tail",
            title,
            Answer.NOT_ENOUGH_DATA,
            n,
            figures,
            thresholds,
            [f"Only {n} requests in the window; the answer needs {t.min_requests}."],
            chart,
        )
    reasons = []
    if share >= t.long_tail_share:
        reasons.append(
            f"{share:.1%} of prompts are over {t.long_prompt_tokens} tokens (threshold {t.long_tail_share:.0%})."
        )
    if ratio is not None and ratio >= t.long_tail_p99_over_p50:
        reasons.append(f"The P99 prompt is {ratio:.1f}× the median (threshold {t.long_tail_p99_over_p50:g}×).")
    if reasons:
        return Finding("long_tail", title, Answer.YES, n, figures, thresholds, reasons, chart)
    return Finding(
        "long_tail",
        title,
        Answer.NO,
        n,
        figures,
        thresholds,
        [
            f"Only {share:.1%} of prompts are over {t.long_prompt_tokens} tokens and the P99 prompt is "
            f"{ratio or 0:.1f}× the median: no long tail."
        ],
        chart,
    )


def _saturated(s: Samples, t: Thresholds) -> np.ndarray:
    waiting = np.asarray(s.waiting, dtype=np.float64)
    running = np.asarray(s.running, dtype=np.float64)
    kv = np.asarray(s.kv_usage, dtype=np.float64)
    seats = np.asarray(s.max_num_seqs, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        full = (running >= seats) | (kv >= t.kv_nearly_full)
        return np.asarray((waiting > 0) & full, dtype=bool)


def concurrency(inputs: Inputs, t: Thresholds) -> Finding:
    s = inputs.samples
    n = len(s.waiting)
    saturated = _saturated(s, t)
    share = float(saturated.mean()) if n else None
    preemptions = inputs.num_preemptions
    queue = inputs.queue_p99_seconds
    figures = {"saturated_waiting_share": share, "queue_p99_seconds": queue, "preemptions": preemptions}
    thresholds = {
        "saturated_share": t.saturated_share,
        "kv_nearly_full": t.kv_nearly_full,
        "queue_p99_seconds": t.queue_p99_seconds,
        "min_samples": t.min_samples,
    }
    chart = {
        "kind": "bar",
        "labels": ["saturated with waiting", "otherwise"],
        "values": [int(saturated.sum()), int(n - saturated.sum())],
        "unit": "scrapes",
    }
    title = "Is concurrency held back?"
    if n < t.min_samples or share is None:
        return Finding(
            "concurrency",
            title,
            Answer.NOT_ENOUGH_DATA,
            n,
            figures,
            thresholds,
            [f"Only {n} scrapes in the window; the answer needs {t.min_samples}."],
            chart,
        )
    reasons = []
    if share >= t.saturated_share:
        reasons.append(
            f"Requests waited while the engine ran at max_num_seqs or with its KV cache over "
            f"{t.kv_nearly_full:.0%} in {share:.1%} of scrapes (threshold {t.saturated_share:.0%})."
        )
    if queue is not None and queue >= t.queue_p99_seconds and (preemptions or 0) > 0:
        reasons.append(
            f"Queue time P99 is {queue:.2f} s (threshold {t.queue_p99_seconds:g} s) with {preemptions:.0f} preemptions."
        )
    if reasons:
        return Finding("concurrency", title, Answer.YES, n, figures, thresholds, reasons, chart)
    return Finding(
        "concurrency",
        title,
        Answer.NO,
        n,
        figures,
        thresholds,
        [
            f"Requests waited at full occupancy in only {share:.1%} of scrapes and the queue P99 is "
            f"{_seconds(queue)}: concurrency is not held back."
        ],
        chart,
    )


def _at_peaks(s: Samples) -> np.ndarray:
    """Each worker's scrapes within 5% of its own highest memory peak."""
    worker = np.asarray(s.worker)
    peak = np.asarray(s.memory_peak_bytes, dtype=np.float64)
    out = np.zeros(len(peak), dtype=bool)
    for w in np.unique(worker):
        mine = (worker == w) & ~np.isnan(peak)
        if mine.any():
            out |= mine & (peak >= 0.95 * peak[mine].max())
    return out


def memory(inputs: Inputs, t: Thresholds) -> Finding:
    s = inputs.samples
    n = len(s.memory_peak_bytes)
    ratio = inputs.memory_peak_to_mean
    peaks = _at_peaks(s)
    kv = np.asarray(s.kv_usage, dtype=np.float64)
    kv_at_peaks = float(np.nanmean(kv[peaks])) if peaks.any() and not np.isnan(kv[peaks]).all() else None
    pre = np.nan_to_num(np.asarray(s.preemptions_delta, dtype=np.float64))
    long_steps = np.nan_to_num(np.asarray(s.long_prefill_steps_delta, dtype=np.float64))
    aligned = float(pre[long_steps > 0].sum())
    figures = {
        "peak_to_mean": ratio,
        "kv_usage_at_peaks": kv_at_peaks,
        "preemptions": float(pre.sum()),
        "preemptions_with_long_prefill": aligned,
    }
    thresholds = {
        "memory_peak_to_mean": t.memory_peak_to_mean,
        "kv_nearly_full": t.kv_nearly_full,
        "min_samples": t.min_samples,
    }
    chart = {
        "kind": "bar",
        "labels": ["preemptions while a long prefill ran", "other preemptions"],
        "values": [aligned, float(pre.sum()) - aligned],
        "unit": "preemptions",
    }
    title = "Does the memory peak cap the batch?"
    if n < t.min_samples or ratio is None:
        return Finding(
            "memory",
            title,
            Answer.NOT_ENOUGH_DATA,
            n,
            figures,
            thresholds,
            [f"Only {n} scrapes (or no memory figures) in the window; the answer needs {t.min_samples}."],
            chart,
        )
    if ratio < t.memory_peak_to_mean:
        return Finding(
            "memory",
            title,
            Answer.NO,
            n,
            figures,
            thresholds,
            [
                f"Memory peaks at {ratio:.2f}× its mean (threshold {t.memory_peak_to_mean:g}×): the peaks are not "
                "what limits the batch."
            ],
            chart,
        )
    full = kv_at_peaks is not None and kv_at_peaks >= t.kv_nearly_full
    if full or aligned > 0:
        reasons = [f"Memory peaks at {ratio:.2f}× its mean (threshold {t.memory_peak_to_mean:g}×)."]
        if full:
            reasons.append(f"At the peaks the KV cache is {kv_at_peaks:.0%} full (threshold {t.kv_nearly_full:.0%}).")
        if aligned > 0:
            reasons.append(f"{aligned:.0f} preemptions happened while a long prefill ran.")
        return Finding("memory", title, Answer.YES, n, figures, thresholds, reasons, chart)
    return Finding(
        "memory",
        title,
        Answer.NO,
        n,
        figures,
        thresholds,
        [
            f"Memory peaks at {ratio:.2f}× its mean, but the KV cache has room at the peaks "
            f"({_percent(kv_at_peaks)}) and no preemption lines up with a long prefill."
        ],
        chart,
    )


def head_of_line(gaps: Gaps, t: Thresholds) -> Finding:
    ratio = None
    if gaps.long_prefill_p99_seconds is not None and gaps.other_p99_seconds:
        ratio = gaps.long_prefill_p99_seconds / gaps.other_p99_seconds
    n = min(gaps.num_long_prefill, gaps.num_other)
    figures = {
        "long_prefill_gap_p99_seconds": gaps.long_prefill_p99_seconds,
        "other_gap_p99_seconds": gaps.other_p99_seconds,
        "ratio": ratio,
        "num_long_prefill_gaps": float(gaps.num_long_prefill),
        "num_other_gaps": float(gaps.num_other),
    }
    thresholds = {"hol_ratio": t.hol_ratio, "long_prefill_tokens": gaps.long_prefill_tokens, "min_gaps": t.min_gaps}
    chart = {
        "kind": "bar",
        "labels": [f"while a prefill > {gaps.long_prefill_tokens} tokens ran", "while none did"],
        "values": [gaps.long_prefill_p99_seconds, gaps.other_p99_seconds],
        "unit": "s",
    }
    title = "Do long prefills stall the requests already decoding?"
    approx = " (approximate: from per-request stats)" if gaps.approximate else ""
    if n < t.min_gaps or ratio is None:
        return Finding(
            "head_of_line",
            title,
            Answer.NOT_ENOUGH_DATA,
            n,
            figures,
            thresholds,
            [
                f"{gaps.num_long_prefill} gaps during long prefills and {gaps.num_other} others; the answer needs "
                f"{t.min_gaps} of each{approx}."
            ],
            chart,
            approximate=gaps.approximate,
        )
    sentence = (
        f"While a prefill of more than {gaps.long_prefill_tokens} tokens runs, the P99 gap between tokens is "
        f"{_seconds(gaps.long_prefill_p99_seconds)} against {_seconds(gaps.other_p99_seconds)} while none "
        f"does: {ratio:.1f}× (threshold {t.hol_ratio:g}×){approx}."
    )
    answer = Answer.YES if ratio >= t.hol_ratio else Answer.NO
    return Finding(
        "head_of_line", title, answer, n, figures, thresholds, [sentence], chart, approximate=gaps.approximate
    )


def overall(answers: Sequence[Finding], hol: Finding) -> tuple[Overall, list[str]]:
    """Two yes of three: likely worth it; fewer yes than two even if every
    unanswered one said yes: not worth it; else not enough data."""
    yes = [a for a in answers if a.answer == Answer.YES]
    unknown = [a for a in answers if a.answer == Answer.NOT_ENOUGH_DATA]
    if len(yes) >= 2:
        reasons = [a.reasons[0] for a in yes]
        if hol.answer == Answer.YES:
            reasons.append(hol.reasons[0])
        elif hol.answer == Answer.NO:
            reasons.append("But long prefills do not stall decodes much yet, so chunking has little to fix today.")
        return Overall.WORTH_IT, reasons
    if len(yes) + len(unknown) < 2:
        return Overall.NOT_WORTH_IT, [
            "At most one of the three questions says yes: the complexity of chunked prefill may not pay.",
            *(a.reasons[0] for a in answers if a.answer == Answer.NO),
        ]
    return Overall.NOT_ENOUGH_DATA, [f"{a.title} {a.reasons[0]}" for a in unknown]


# ---- starting knobs -----------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    chunk_tokens: int | None
    chunk_tokens_high: int | None
    short_prompt_threshold: int | None
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    reasons: list[str]
    figures: dict[str, float | None]

    def profile_fields(self) -> dict[str, Any]:
        """The suggested arm as ``EngineProfile`` fields (only what is known)."""
        fields: dict[str, Any] = {"prefill_mode": "chunked"}
        if self.max_num_batched_tokens is not None:
            fields["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.chunk_tokens is not None:
            fields["long_prefill_token_threshold"] = self.chunk_tokens
        if self.short_prompt_threshold is not None:
            fields["short_prompt_threshold"] = self.short_prompt_threshold
        return fields

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "profile_fields": self.profile_fields()}


def _round_down(value: float, multiple: int) -> int:
    return max(multiple, int(value // multiple) * multiple)


def knobs(inputs: Inputs, t: Thresholds) -> Knobs:
    """A chunk whose prefill activation peak stays within ¼–⅓ of the memory
    left after weights; a short-prompt threshold at the median prompt still to
    compute after its prefix hit (those run whole); a budget with a seat for
    every running decode beside one full chunk."""
    e, p = inputs.engine, inputs.profile
    block = p.block_size if p else 16
    seats = p.max_num_seqs if p else None
    reasons: list[str] = []
    figures: dict[str, float | None] = {
        "device_memory_bytes": e.device_memory_bytes,
        "weight_bytes": e.weight_bytes,
        "activation_bytes_per_token": e.activation_bytes_per_token,
    }
    chunk = chunk_high = None
    if e.device_memory_bytes and e.weight_bytes is not None and e.activation_bytes_per_token:
        left = max(0.0, e.device_memory_bytes - e.weight_bytes)
        figures["memory_after_weights_bytes"] = left
        chunk = _round_down(left * t.activation_share_low / e.activation_bytes_per_token, block)
        chunk_high = _round_down(left * t.activation_share_high / e.activation_bytes_per_token, block)
        if e.max_model_len:
            chunk, chunk_high = min(chunk, e.max_model_len), min(chunk_high, e.max_model_len)
        reasons.append(
            f"A chunk of {chunk}–{chunk_high} tokens keeps the prefill activation peak "
            f"({e.activation_bytes_per_token:,.0f} bytes per token, measured) within "
            f"{t.activation_share_low:.0%}–{t.activation_share_high:.0%} of the {_gib(left)} left after weights."
        )
    else:
        reasons.append(
            "No chunk size: the workers do not report their memory after weights and activation per token yet."
        )
    to_compute = [
        max(0, n - (c or 0)) for n, c in zip(inputs.requests.prompt_tokens, inputs.requests.cached_tokens, strict=True)
    ]
    short = None
    median = percentile(to_compute, 50)
    if median is not None:
        short = max(block, int(math.ceil(median / block) * block))
        if chunk is not None:
            short = min(short, chunk)
        reasons.append(
            f"short_prompt_threshold {short}: half the prompts have at most {median:.0f} tokens left to "
            "compute after their prefix-cache hit, and those run whole, never split."
        )
    budget = None
    if chunk is not None and seats is not None:
        budget = chunk + seats
        reasons.append(
            f"max_num_batched_tokens {budget}: one full chunk beside one decode token for each of the "
            f"max_num_seqs={seats} running requests."
        )
    figures["median_tokens_to_compute"] = median
    return Knobs(chunk, chunk_high, short, budget, seats, reasons, figures)


# ---- is a chunked pool tuned right? ------------------------------------------------------


def _finding(
    key: str,
    title: str,
    answer: Answer,
    n: int,
    figures: Mapping[str, float | None],
    thresholds: dict[str, float],
    reason: str,
    knob: str = "",
    direction: str = "",
) -> Finding:
    return Finding(key, title, answer, n, dict(figures), thresholds, [reason], knob=knob, direction=direction)


def chunk_too_small(inputs: Inputs, t: Thresholds) -> Finding:
    pool, base = inputs.pool, inputs.baseline
    title = "Is the chunk too small?"
    thresholds = {"chunk_too_small_throughput_drop": t.chunk_too_small_throughput_drop, "min_requests": t.min_requests}
    if pool is None or base is None:
        return _finding(
            "chunk_too_small",
            title,
            Answer.NOT_ENOUGH_DATA,
            pool.num_requests if pool else 0,
            {},
            thresholds,
            "No stable or monolithic baseline to compare throughput with.",
        )
    n = min(pool.num_requests, base.num_requests)
    figures = {
        "throughput_per_worker": pool.output_tokens_per_second_per_worker,
        "baseline_throughput_per_worker": base.output_tokens_per_second_per_worker,
        "stall_p99_seconds": pool.stall_p99_seconds,
        "baseline_stall_p99_seconds": base.stall_p99_seconds,
    }
    if (
        n < t.min_requests
        or not base.output_tokens_per_second_per_worker
        or pool.output_tokens_per_second_per_worker is None
        or pool.stall_p99_seconds is None
        or base.stall_p99_seconds is None
    ):
        return _finding(
            "chunk_too_small",
            title,
            Answer.NOT_ENOUGH_DATA,
            n,
            figures,
            thresholds,
            f"{n} requests on the smaller side; the answer needs {t.min_requests} and both throughputs.",
        )
    drop = 1 - pool.output_tokens_per_second_per_worker / base.output_tokens_per_second_per_worker
    figures["throughput_drop"] = drop
    improved = pool.stall_p99_seconds < base.stall_p99_seconds
    if drop > t.chunk_too_small_throughput_drop and improved:
        return _finding(
            "chunk_too_small",
            title,
            Answer.YES,
            n,
            figures,
            thresholds,
            f"Throughput per worker is {drop:.0%} below {base.name or 'the baseline'} (threshold "
            f"{t.chunk_too_small_throughput_drop:.0%}) while stalls improved: raise the chunk size "
            "(long_prefill_token_threshold).",
            "long_prefill_token_threshold",
            "raise",
        )
    return _finding(
        "chunk_too_small",
        title,
        Answer.NO,
        n,
        figures,
        thresholds,
        f"Throughput per worker is within {t.chunk_too_small_throughput_drop:.0%} of "
        f"{base.name or 'the baseline'} ({-drop:+.0%}), or stalls did not improve.",
    )


def budget_too_large(inputs: Inputs, hol: Finding, t: Thresholds) -> Finding:
    """Chunking nominally on, yet decodes still stall: against a monolithic
    baseline the stall P99 is not ``budget_min_stall_gain``× better, or with
    none, the pool's own long prefills still stall its decodes."""
    pool, base = inputs.pool, inputs.baseline
    title = "Is the budget too large?"
    thresholds = {
        "budget_min_stall_gain": t.budget_min_stall_gain,
        "hol_ratio": t.hol_ratio,
        "min_requests": t.min_requests,
    }
    knob, direction = "max_num_batched_tokens", "lower"
    if base is not None and base.prefill_mode == "monolithic" and pool is not None:
        n = min(pool.num_requests, base.num_requests)
        figures = {"stall_p99_seconds": pool.stall_p99_seconds, "baseline_stall_p99_seconds": base.stall_p99_seconds}
        if n >= t.min_requests and pool.stall_p99_seconds and base.stall_p99_seconds is not None:
            gain = base.stall_p99_seconds / pool.stall_p99_seconds
            figures["stall_gain"] = gain
            if gain < t.budget_min_stall_gain:
                return _finding(
                    "budget_too_large",
                    title,
                    Answer.YES,
                    n,
                    figures,
                    thresholds,
                    f"The stall P99 is only {gain:.1f}× better than monolithic {base.name} (threshold "
                    f"{t.budget_min_stall_gain:g}×): lower max_num_batched_tokens (and the chunk cap).",
                    knob,
                    direction,
                )
            return _finding(
                "budget_too_large",
                title,
                Answer.NO,
                n,
                figures,
                thresholds,
                f"The stall P99 is {gain:.1f}× better than monolithic {base.name}.",
            )
    if hol.answer == Answer.NOT_ENOUGH_DATA:
        return _finding(
            "budget_too_large",
            title,
            Answer.NOT_ENOUGH_DATA,
            hol.num_samples,
            hol.figures,
            thresholds,
            "No monolithic baseline with enough requests, and too few gaps to judge the pool's own.",
        )
    ratio = hol.figures["ratio"] or 0.0
    if hol.answer == Answer.YES:
        return _finding(
            "budget_too_large",
            title,
            Answer.YES,
            hol.num_samples,
            hol.figures,
            thresholds,
            f"Chunking is on, yet decodes stall {ratio:.1f}× longer while a long prefill runs (threshold "
            f"{t.hol_ratio:g}×), as under monolithic prefill: lower max_num_batched_tokens (and the "
            "chunk cap).",
            knob,
            direction,
        )
    return _finding(
        "budget_too_large",
        title,
        Answer.NO,
        hol.num_samples,
        hol.figures,
        thresholds,
        f"Decode gaps during long prefills are {ratio:.1f}× the others: the budget keeps them in check.",
    )


def starvation(requests: Requests, t: Thresholds) -> list[Finding]:
    """Long prompts starved: their TTFT P50, per prompt token, against short
    prompts'. Short ones starved: their TTFT while a long prompt was
    prefilling (arrived between its arrival and first token) against otherwise."""
    created = np.asarray(requests.created, dtype=np.float64)
    lengths = np.asarray(requests.prompt_tokens, dtype=np.float64)
    ttft = np.asarray([np.nan if v is None else v for v in requests.ttft_seconds], dtype=np.float64)
    ok = np.asarray(requests.ok, dtype=bool) & ~np.isnan(ttft)
    long = ok & (lengths > t.long_prompt_tokens)
    short = ok & (lengths <= t.long_prompt_tokens)
    thresholds = {
        "starvation_ratio": t.starvation_ratio,
        "long_prompt_tokens": t.long_prompt_tokens,
        "min_requests": t.min_requests,
    }
    out = []
    title = "Do short prompts starve long ones?"
    n = int(min(long.sum(), short.sum()))
    if n < 1 or short.sum() + long.sum() < t.min_requests:
        out.append(
            _finding(
                "long_starved",
                title,
                Answer.NOT_ENOUGH_DATA,
                n,
                {},
                thresholds,
                f"{int(long.sum())} long and {int(short.sum())} short requests; the answer needs some of "
                f"each and {t.min_requests} in all.",
            )
        )
    else:
        long_rate = float(np.median(ttft[long] / np.maximum(lengths[long], 1)))
        short_rate = float(np.median(ttft[short] / np.maximum(lengths[short], 1)))
        ratio = long_rate / short_rate if short_rate > 0 else math.inf
        figures = {"long_ttft_per_token_seconds": long_rate, "short_ttft_per_token_seconds": short_rate, "ratio": ratio}
        if ratio >= t.starvation_ratio:
            out.append(
                _finding(
                    "long_starved",
                    title,
                    Answer.YES,
                    n,
                    figures,
                    thresholds,
                    f"Long prompts wait {ratio:.1f}× longer per prompt token for their first token than "
                    f"short ones (threshold {t.starvation_ratio:g}×): raise min_prefill_tokens_per_step.",
                    "min_prefill_tokens_per_step",
                    "raise",
                )
            )
        else:
            out.append(
                _finding(
                    "long_starved",
                    title,
                    Answer.NO,
                    n,
                    figures,
                    thresholds,
                    f"Long prompts' first token per prompt token is {ratio:.1f}× short ones'.",
                )
            )
    title = "Do long prompts starve short ones?"
    starts = created[long]
    ends = starts + ttft[long]
    during = np.zeros(len(created), dtype=bool)
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        during |= (created > a) & (created < b)
    hit, rest = short & during, short & ~during
    n = int(min(hit.sum(), rest.sum()))
    if n < 1 or short.sum() < t.min_requests:
        out.append(
            _finding(
                "short_starved",
                title,
                Answer.NOT_ENOUGH_DATA,
                n,
                {},
                thresholds,
                f"{int(hit.sum())} short requests arrived during a long prefill, {int(rest.sum())} "
                f"otherwise; the answer needs some of each and {t.min_requests} short ones.",
            )
        )
        return out
    during_p99 = percentile(ttft[hit].tolist(), 99) or 0.0
    other_p99 = percentile(ttft[rest].tolist(), 99) or 0.0
    ratio = during_p99 / other_p99 if other_p99 > 0 else math.inf
    figures = {
        "short_ttft_p99_during_long_seconds": during_p99,
        "short_ttft_p99_otherwise_seconds": other_p99,
        "ratio": ratio,
    }
    if ratio >= t.starvation_ratio:
        out.append(
            _finding(
                "short_starved",
                title,
                Answer.YES,
                n,
                figures,
                thresholds,
                f"Short prompts arriving during a long prefill wait {ratio:.1f}× longer for their first "
                f"token (P99 {_seconds(during_p99)} against {_seconds(other_p99)}; threshold "
                f"{t.starvation_ratio:g}×): lower the chunk cap (long_prefill_token_threshold).",
                "long_prefill_token_threshold",
                "lower",
            )
        )
    else:
        out.append(
            _finding(
                "short_starved",
                title,
                Answer.NO,
                n,
                figures,
                thresholds,
                f"Short prompts' TTFT P99 during long prefills is {ratio:.1f}× the rest.",
            )
        )
    return out


# ---- prefill-decode disaggregation -------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8": 1, "fp8": 1}


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int | None = None) -> int:
    """K and V of one token across every layer, from a Hugging Face config:
    2 × layers × KV heads × head size × element bytes."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    elem = dtype_bytes or DTYPE_BYTES[str(config.get("torch_dtype", "float32"))]
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * elem


PD_FORMULA = (
    "transfer share = (KV bytes per token ÷ link bandwidth) ÷ prefill seconds per token; "
    "a prompt token's prefill is the interference removed from the decodes, its KV the bytes to move"
)


def pd_estimate(
    kv_bytes: float | None, prefill_seconds_per_token: float | None, hol: Finding, t: Thresholds
) -> Finding:
    title = "Would prefill-decode disaggregation pay? (an estimate, not a measurement)"
    bandwidth = t.link_bandwidth_bytes_per_second
    thresholds = {"link_bandwidth_bytes_per_second": bandwidth, "pd_max_transfer_share": t.pd_max_transfer_share}
    figures: dict[str, float | None] = {
        "kv_bytes_per_token": kv_bytes,
        "prefill_seconds_per_token": prefill_seconds_per_token,
    }
    if not kv_bytes or not prefill_seconds_per_token:
        return Finding(
            "pd",
            title,
            Answer.NOT_ENOUGH_DATA,
            0,
            figures,
            thresholds,
            ["No KV bytes per token or measured prefill time per token from the workers yet."],
            {"formula": PD_FORMULA},
        )
    transfer = kv_bytes / bandwidth
    share = transfer / prefill_seconds_per_token
    figures.update({"transfer_seconds_per_token": transfer, "transfer_share": share})
    formula = (
        f"({kv_bytes:,.0f} B/token ÷ {bandwidth / 1e9:g} GB/s) ÷ {prefill_seconds_per_token * 1e6:.3g} µs/token"
        f" = {transfer * 1e9:.3g} ns ÷ {prefill_seconds_per_token * 1e9:.3g} ns = {share:.3g}"
    )
    cheap = share <= t.pd_max_transfer_share
    stalls = hol.answer == Answer.YES
    if cheap and stalls:
        reason = (
            f"Moving a token's KV takes {share:.1%} of the time its prefill stalls decodes (threshold "
            f"{t.pd_max_transfer_share:.0%}), and long prefills do stall decodes here: a PD route would "
            "likely pay (estimate)."
        )
        answer = Answer.YES
    elif cheap:
        reason = (
            f"The transfer is cheap ({share:.1%} of the prefill time) but long prefills do not stall decodes "
            "measurably, so there is little interference to remove (estimate)."
        )
        answer = Answer.NO
    else:
        reason = (
            f"Moving a token's KV takes {share:.1%} of its prefill time (threshold {t.pd_max_transfer_share:.0%}):"
            " the transfer costs about as much as the interference it removes (estimate)."
        )
        answer = Answer.NO
    return Finding("pd", title, answer, 1, figures, thresholds, [reason], {"formula": PD_FORMULA, "computed": formula})


# ---- prefix hits per length bucket ----------------------------------------------------------


def prefix_hits_by_bucket(requests: Requests) -> dict[str, Any]:
    """Cached prompt tokens over prompt tokens per length bucket, from the
    gateway log's cached tokens (rows where the gateway learnt them)."""
    prompt: dict[str, int] = {}
    cached: dict[str, int] = {}
    known = 0
    for n, c in zip(requests.prompt_tokens, requests.cached_tokens, strict=True):
        if c is None:
            continue
        known += 1
        b = prompt_bucket(n)
        prompt[b] = prompt.get(b, 0) + n
        cached[b] = cached.get(b, 0) + c
    labels = [name for name, _ in PROMPT_BUCKETS]
    return {
        "kind": "bar",
        "unit": "ratio",
        "labels": labels,
        "values": [cached[b] / prompt[b] if prompt.get(b) else None for b in labels],
        "num_requests_with_cached_tokens": known,
        "num_requests": len(requests.prompt_tokens),
    }


# ---- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    overall: Overall
    overall_reasons: list[str]
    questions: list[Finding]
    head_of_line: Finding
    knobs: Knobs
    tuning: list[Finding]  # empty unless the pool runs chunked
    pd: Finding
    prefix_hits: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "overall": self.overall.value,
            "overall_reasons": self.overall_reasons,
            "questions": [q.to_json() for q in self.questions],
            "head_of_line": self.head_of_line.to_json(),
            "knobs": self.knobs.to_json(),
            "tuning": [f.to_json() for f in self.tuning],
            "pd": self.pd.to_json(),
            "prefix_hits": self.prefix_hits,
        }


def advise(inputs: Inputs, t: Thresholds) -> Report:
    questions = [long_tail(inputs.requests, t), concurrency(inputs, t), memory(inputs, t)]
    hol = head_of_line(inputs.gaps, t)
    verdict, reasons = overall(questions, hol)
    tuning: list[Finding] = []
    if inputs.profile is not None and inputs.profile.prefill_mode == "chunked":
        tuning = [chunk_too_small(inputs, t), budget_too_large(inputs, hol, t), *starvation(inputs.requests, t)]
    pd = pd_estimate(inputs.engine.kv_bytes_per_token, inputs.engine.prefill_seconds_per_token, hol, t)
    return Report(
        verdict, reasons, questions, hol, knobs(inputs, t), tuning, pd, prefix_hits_by_bucket(inputs.requests)
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "unknown"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _percent(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"
