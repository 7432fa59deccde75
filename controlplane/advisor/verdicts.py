"""The advisor's answers: does this traffic need chunked prefill, with which
knobs, and is a chunked pool tuned right. Pure: dataclasses in and out, no
Django, no I/O (``inputs.py`` gathers the facts from live figures).

Design note. The main reason to adopt chunked prefill is the decode stall: a
long prompt prefilled in one step holds up every request already decoding.
So the overall verdict comes from a decision table (``DECISION_TABLE``, which
the page shows) whose first input is the decode-stall evidence against the
pool's TBT objective (``stalls``): the P99 gap between tokens of requests
decoding while a long prefill ran, the P99 of the other gaps and the P99 of
each request's largest gap. When long prefills push the gap P99 past the
objective, chunking is worth it, whatever else is true. Three questions then
say how much more it gives, each yes, no or not enough data with its count:

* long tail — is the prompt-length distribution long-tailed?
* concurrency held back — do requests wait while the engine runs at
  ``max_num_seqs`` or with its KV cache nearly full?
* memory peak caps the batch — is the memory peak far above its mean, with
  the KV cache full at the peaks or preemptions while long prefills run?

Every length and time is relative to the model and the pool, never absolute:
a prompt is long (``long_prompt``) when its prefill alone would break the TBT
objective, when it spans a few of the pool's chunk caps, or when it fills a
share of the context. The starting knobs (``knobs``) follow Sarathi-Serve:
the largest budget whose step (the typical decode batch plus one chunk)
fits the TBT objective, from the measured prefill time per token and decode
step time, then bounded by memory and by the context. The findings on a
chunked pool (``tuning``) judge the budget against the same step time.

Every threshold is one row of ``Thresholds`` (field, default, unit,
meaning); the tunables (``conf.py``) and the page's formatting derive from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

import numpy as np

from workers.figures import PROMPT_BUCKETS, percentile, prompt_bucket


class Answer(StrEnum):
    YES = "yes"
    NO = "no"
    NOT_ENOUGH_DATA = "not_enough_data"


ANSWER_TEXT = {Answer.YES: "Yes", Answer.NO: "No", Answer.NOT_ENOUGH_DATA: "Not enough data"}


class Overall(StrEnum):
    WORTH_IT = "worth_it"
    NOT_WORTH_IT = "not_worth_it"
    OTHER_CAUSE = "other_cause"
    NOT_ENOUGH_DATA = "not_enough_data"


class Stall(StrEnum):
    """What the decode-stall evidence says, against the TBT objective."""

    LONG_PREFILL = "long_prefill"  # long prefills push the decode gap P99 past the objective
    OTHER = "other"  # decodes miss the objective even without long prefills
    NONE = "none"  # no stall breaks the objective
    UNKNOWN = "unknown"  # too few samples, or no objective
    PREVENTED = "prevented"  # a chunked pool whose chunking is what keeps long prefills inside the objective


# ---- the thresholds: one table ------------------------------------------------------


def _row(default: float, unit: str, meaning: str) -> Any:
    return field(default=default, metadata={"unit": unit, "meaning": meaning})


@dataclass(frozen=True)
class Thresholds:
    """Every threshold an answer uses, one row each: field, default, unit and
    meaning. ``conf.py`` makes each an ``ADVISOR_<FIELD>`` tunable; the page
    formats each by its unit."""

    min_requests: int = _row(100, "requests", "fewer logged requests in the window: not enough data")
    min_samples: int = _row(
        20, "samples", "fewer kept samples (scrapes, or minute samples) in the window: not enough data"
    )
    min_gaps: int = _row(50, "gaps", "fewer decode gaps during (or outside) long prefills: not judged")
    long_prompt_context_share: float = _row(0.25, "share", "a prompt over this share of max_model_len is long")
    long_prompt_chunks: int = _row(4, "chunks", "on a chunked pool, a prompt over this many chunk caps is long")
    long_tail_share: float = _row(0.05, "share", "long tail: at least this share of prompts is long")
    long_tail_p99_over_p50: float = _row(
        8.0, "times", "long tail: or the P99 prompt is at least this many times the median"
    )
    saturated_share: float = _row(
        0.10,
        "share",
        "concurrency held back: requests waited at max_num_seqs or a nearly full KV cache in this share of samples",
    )
    kv_nearly_full: float = _row(0.90, "share", "KV cache usage at or above this is nearly full")
    queue_p99_seconds: float = _row(
        1.0, "s", "concurrency held back: or queue time P99 at least this, with preemptions"
    )
    memory_peak_to_mean: float = _row(
        1.5, "times", "memory peak caps the batch: peak/mean at least this (and KV full or preemptions)"
    )
    hol_ratio: float = _row(
        2.0,
        "times",
        "decode stalls: when the gaps without long prefills miss the TBT objective too, the report notes "
        "long prefills making them this many times worse",
    )
    chunk_too_small_drop: float = _row(
        0.15, "share", "chunk too small: throughput per worker this share below the baseline"
    )
    budget_step_over_tbt: float = _row(
        1.0,
        "times",
        "budget too large: the step it implies (prefill time per token × budget + decode step) over "
        "this many times the TBT objective",
    )
    starvation_ratio: float = _row(3.0, "times", "starvation: one kind's wait at least this many times the other's")
    activation_share_low: float = _row(
        0.25,
        "share",
        "starting chunk: its prefill activation peak at least this share of the memory left after weights",
    )
    activation_share_high: float = _row(0.33, "share", "starting chunk: and at most this share")
    link_bandwidth_gbps: float = _row(25.0, "GB/s", "PD estimate: the prefill-to-decode link's bandwidth")
    pd_max_transfer_share: float = _row(
        0.5, "share", "PD estimate: pays when the KV transfer is at most this share of the prefill time"
    )
    pd_min_gain: float = _row(
        1.1,
        "times",
        "PD database estimate: pays when disaggregated tokens/s per GPU beat aggregated by at least this factor",
    )


@dataclass(frozen=True)
class ThresholdRow:
    field: str
    default: float
    unit: str
    meaning: str


THRESHOLDS: tuple[ThresholdRow, ...] = tuple(
    ThresholdRow(f.name, getattr(Thresholds, f.name), f.metadata["unit"], f.metadata["meaning"])
    for f in fields(Thresholds)
)
THRESHOLD_UNITS: dict[str, str] = {row.field: row.unit for row in THRESHOLDS}

# The unit of every figure a finding or the knobs report, so the page formats
# each once ("s", "share", "times", "tokens", "bytes", "B/token", "s/token",
# "count"); a test checks every figure has one.
FIGURE_UNITS: dict[str, str] = {
    # long tail
    "long_prompt_tokens": "tokens",
    "share_over_long": "share",
    "p50_tokens": "tokens",
    "p99_tokens": "tokens",
    "p99_over_p50": "times",
    # concurrency and memory
    "saturated_waiting_share": "share",
    "queue_p99_seconds": "s",
    "preemptions": "count",
    "peak_to_mean": "times",
    "kv_usage_at_peaks": "share",
    "preemptions_with_long_prefill": "count",
    # decode stalls
    "long_prefill_gap_p99_seconds": "s",
    "other_gap_p99_seconds": "s",
    "ratio": "times",
    "stall_p99_seconds": "s",
    "tbt_objective_seconds": "s",
    "long_prefill_tokens": "tokens",
    "num_long_prefill_gaps": "count",
    "num_other_gaps": "count",
    "num_stall_requests": "count",
    # tuning
    "throughput_per_worker": "tokens/s",
    "baseline_throughput_per_worker": "tokens/s",
    "baseline_stall_p99_seconds": "s",
    "throughput_drop": "share",
    "max_num_batched_tokens": "tokens",
    "chunk_cap": "tokens",
    "max_model_len": "tokens",
    "prefill_seconds_per_token": "s/token",
    "decode_step_seconds": "s",
    "budget_step_seconds": "s",
    "long_ttft_per_token_seconds": "s/token",
    "short_ttft_per_token_seconds": "s/token",
    "short_ttft_p99_during_long_seconds": "s",
    "short_ttft_p99_otherwise_seconds": "s",
    # PD and knobs
    "kv_bytes_per_token": "B/token",
    "transfer_seconds_per_token": "s/token",
    "transfer_share": "share",
    "agg_tokens_per_second_per_gpu": "tokens/s",
    "disagg_tokens_per_second_per_gpu": "tokens/s",
    "disagg_over_agg": "times",
    "sweep_seconds": "s",
    "device_memory_bytes": "bytes",
    "weight_bytes": "bytes",
    "activation_bytes_per_token": "B/token",
    "memory_after_weights_bytes": "bytes",
    "running_p90": "count",
    "median_tokens_to_compute": "tokens",
}


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


@dataclass(frozen=True)
class Question:
    """One question's fixed parts; ``yes``/``no``/``not_enough`` build its
    finding, so every finding is made the same way."""

    key: str
    title: str
    t: Thresholds
    uses: tuple[str, ...]  # the threshold fields it reads
    chart: dict[str, Any] = field(default_factory=dict)
    knob: str = ""
    direction: str = ""
    approximate: bool = False

    def _finding(
        self, answer: Answer, n: int, figures: Mapping[str, float | None], reasons: Sequence[str], advise: bool
    ) -> Finding:
        return Finding(
            self.key,
            self.title,
            answer,
            int(n),
            dict(figures),
            {name: getattr(self.t, name) for name in self.uses},
            list(reasons),
            self.chart,
            self.knob if advise else "",
            self.direction if advise else "",
            self.approximate,
        )

    def yes(self, n: int, figures: Mapping[str, float | None], *reasons: str) -> Finding:
        return self._finding(Answer.YES, n, figures, reasons, True)

    def no(self, n: int, figures: Mapping[str, float | None], *reasons: str) -> Finding:
        return self._finding(Answer.NO, n, figures, reasons, False)

    def not_enough(self, n: int, figures: Mapping[str, float | None], *reasons: str) -> Finding:
        return self._finding(Answer.NOT_ENOUGH_DATA, n, figures, reasons, False)

    def judge(self, n: int, figures: Mapping[str, float | None], yes: Sequence[str], no: str) -> Finding:
        """Yes with the reasons that hold, else no."""
        return self.yes(n, figures, *yes) if yes else self.no(n, figures, no)


# ---- inputs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """The gateway's log rows of the window (successful or not), in arrival
    order. A refused request (429) has no prompt length: None, never 0."""

    prompt_tokens: Sequence[int | None]
    cached_tokens: Sequence[int | None]  # None: the gateway did not learn it
    created: Sequence[float]  # epoch seconds
    ttft_seconds: Sequence[float | None]
    ok: Sequence[bool]
    output_tokens: Sequence[int | None] = ()  # None: the gateway did not learn it


@dataclass(frozen=True)
class Samples:
    """One row per kept sample of every worker in the group, each worker's
    rows consecutive and in time order. Deltas are since the worker's previous
    row (NaN for its first). ``unit`` says what a row is: a scrape, or past ten
    minutes a minute sample."""

    worker: Sequence[int]
    waiting: Sequence[float]
    running: Sequence[float]
    kv_usage: Sequence[float]
    max_num_seqs: Sequence[float]  # what the worker's profile allowed then; NaN: unknown
    memory_peak_bytes: Sequence[float]
    preemptions_delta: Sequence[float]
    long_prefill_steps_delta: Sequence[float]
    unit: str = "scrapes"


@dataclass(frozen=True)
class Gaps:
    """Gaps between consecutive tokens of the same request, split by whether a
    prefill of more than ``long_prefill_tokens`` ran during the gap."""

    long_prefill_p99_seconds: float | None
    other_p99_seconds: float | None
    num_long_prefill: int
    num_other: int
    long_prefill_tokens: int | None
    approximate: bool = False  # from per-request stats (the gateway log), not per-token records


@dataclass(frozen=True)
class Decode:
    """The decode side against the pool's TBT objective."""

    tbt_objective_seconds: float | None = None
    stall_p99_seconds: float | None = None  # each request's largest gap, P99 over requests
    num_stall_requests: int = 0
    step_seconds: float | None = None  # a decode step: the ITL P50


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
    """What the workers say about their memory, speed and model."""

    device_memory_bytes: float | None
    weight_bytes: float | None
    activation_bytes_per_token: float | None  # prefill step's transient peak per token
    kv_bytes_per_token: float | None
    prefill_seconds_per_token: float | None
    max_model_len: int | None = None
    device: str = ""


@dataclass(frozen=True)
class Throughput:
    """A pool's (or its baseline's) figures for the chunk-size finding."""

    output_tokens_per_second_per_worker: float | None
    stall_p99_seconds: float | None
    num_requests: int
    prefill_mode: str = ""
    name: str = ""


@dataclass(frozen=True)
class PdDatabase:
    """AIConfigurator's estimate for a pool (``pd.py`` sweeps the database):
    its inputs (system, backend, database version, model, prompt and output
    lengths, objectives) and each side's best configuration under the
    objectives, or why there is none."""

    inputs: dict[str, Any]
    agg_tokens_per_second_per_gpu: float | None = None
    disagg_tokens_per_second_per_gpu: float | None = None
    agg_best: dict[str, Any] = field(default_factory=dict)
    disagg_best: dict[str, Any] = field(default_factory=dict)
    unavailable: str = ""  # why there is no estimate
    sweep_seconds: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PdDatabase:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


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
    decode: Decode = Decode()
    pd_database: PdDatabase | None = None  # pd.py's estimate; None: not asked for


# ---- what is long, here ------------------------------------------------------------


@dataclass(frozen=True)
class LongPrompt:
    tokens: int | None  # None: nothing known to judge by
    basis: str


def long_prompt(inputs: Inputs, t: Thresholds) -> LongPrompt:
    """The shortest of: a prompt whose prefill alone would take longer than
    the TBT objective; on a chunked pool, one over ``long_prompt_chunks``
    chunk caps; one over ``long_prompt_context_share`` of the context."""
    e, p, tbt = inputs.engine, inputs.profile, inputs.decode.tbt_objective_seconds
    candidates: list[tuple[int, str]] = []
    if tbt and e.prefill_seconds_per_token:
        candidates.append(
            (
                int(tbt / e.prefill_seconds_per_token),
                f"its prefill alone ({_seconds(e.prefill_seconds_per_token)} per token) would take longer "
                f"than the TBT objective ({_seconds(tbt)})",
            )
        )
    if p is not None and p.prefill_mode == "chunked":
        candidates.append(
            (
                t.long_prompt_chunks * p.chunk_cap,
                f"it spans more than {t.long_prompt_chunks} chunk caps of {p.chunk_cap:,}",
            )
        )
    if e.max_model_len:
        candidates.append(
            (
                int(e.max_model_len * t.long_prompt_context_share),
                f"it fills more than {t.long_prompt_context_share:.0%} of the {e.max_model_len:,}-token context",
            )
        )
    if not candidates:
        return LongPrompt(None, "No max_model_len, chunk cap or prefill time per token known to say what is long.")
    tokens, why = min(candidates)
    tokens = max(1, tokens)
    return LongPrompt(tokens, f"A prompt over {tokens:,} tokens is long here: {why}.")


def _known(requests: Requests, *, ok_only: bool) -> np.ndarray:
    """Prompt lengths of the rows that have one (successful ones only, if asked)."""
    return np.asarray(
        [n for n, ok in zip(requests.prompt_tokens, requests.ok, strict=True) if n is not None and (ok or not ok_only)],
        dtype=np.float64,
    )


# ---- the three questions -----------------------------------------------------------


def _length_histogram(lengths: np.ndarray) -> dict[str, Any]:
    labels = [name for name, _ in PROMPT_BUCKETS]
    counts = dict.fromkeys(labels, 0)
    for n in lengths.tolist():
        counts[prompt_bucket(int(n))] += 1
    return {"kind": "bar", "labels": labels, "values": [counts[label] for label in labels], "unit": "requests"}


def long_tail(requests: Requests, long: LongPrompt, t: Thresholds) -> Finding:
    lengths = _known(requests, ok_only=False)
    n = len(lengths)
    p50 = percentile(lengths.tolist(), 50)
    p99 = percentile(lengths.tolist(), 99)
    share = float((lengths > long.tokens).mean()) if n and long.tokens is not None else None
    ratio = p99 / p50 if p50 and p99 is not None else None
    figures = {
        "long_prompt_tokens": long.tokens,
        "share_over_long": share,
        "p50_tokens": p50,
        "p99_tokens": p99,
        "p99_over_p50": ratio,
    }
    ask = Question(
        "long_tail",
        "Is the prompt-length distribution long-tailed?",
        t,
        (
            "long_prompt_context_share",
            "long_prompt_chunks",
            "long_tail_share",
            "long_tail_p99_over_p50",
            "min_requests",
        ),
        _length_histogram(lengths),
    )
    if n < t.min_requests:
        return ask.not_enough(
            n, figures, f"Only {n} requests with a prompt length in the window; the answer needs {t.min_requests}."
        )
    if share is None or long.tokens is None:
        return ask.not_enough(n, figures, long.basis)
    yes = []
    if share >= t.long_tail_share:
        yes.append(f"{share:.1%} of prompts are over {long.tokens:,} tokens (threshold {t.long_tail_share:.0%}).")
    if ratio is not None and ratio >= t.long_tail_p99_over_p50:
        yes.append(f"The P99 prompt is {ratio:.1f}× the median (threshold {t.long_tail_p99_over_p50:g}×).")
    if yes:
        yes.append(long.basis)
    return ask.judge(
        n,
        figures,
        yes,
        f"Only {share:.1%} of prompts are over {long.tokens:,} tokens and the P99 prompt is {ratio or 0:.1f}× the "
        f"median: no long tail. {long.basis}",
    )


def _saturated(s: Samples, t: Thresholds) -> np.ndarray:
    waiting = np.asarray(s.waiting, dtype=np.float64)
    running = np.asarray(s.running, dtype=np.float64)
    kv = np.asarray(s.kv_usage, dtype=np.float64)
    seats = np.asarray(s.max_num_seqs, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        full = (running >= seats) | (kv >= t.kv_nearly_full)
        return np.asarray((waiting > 0) & full, dtype=bool)


def _too_few_samples(s: Samples, t: Thresholds, extra: str = "") -> str:
    return f"Only {len(s.waiting)} {s.unit}{extra} in the window; the answer needs {t.min_samples}."


def concurrency(inputs: Inputs, t: Thresholds) -> Finding:
    s = inputs.samples
    n = len(s.waiting)
    saturated = _saturated(s, t)
    share = float(saturated.mean()) if n else None
    preemptions, queue = inputs.num_preemptions, inputs.queue_p99_seconds
    figures = {"saturated_waiting_share": share, "queue_p99_seconds": queue, "preemptions": preemptions}
    ask = Question(
        "concurrency",
        "Is concurrency held back?",
        t,
        ("saturated_share", "kv_nearly_full", "queue_p99_seconds", "min_samples"),
        {
            "kind": "bar",
            "labels": ["saturated with waiting", "otherwise"],
            "values": [int(saturated.sum()), int(n - saturated.sum())],
            "unit": s.unit,
        },
    )
    if n < t.min_samples or share is None:
        return ask.not_enough(n, figures, _too_few_samples(s, t))
    yes = []
    if share >= t.saturated_share:
        yes.append(
            f"Requests waited while the engine ran at max_num_seqs or with its KV cache over "
            f"{t.kv_nearly_full:.0%} in {share:.1%} of {s.unit} (threshold {t.saturated_share:.0%})."
        )
    if queue is not None and queue >= t.queue_p99_seconds and (preemptions or 0) > 0:
        yes.append(
            f"Queue time P99 is {queue:.2f} s (threshold {t.queue_p99_seconds:g} s) with {preemptions:.0f} preemptions."
        )
    return ask.judge(
        n,
        figures,
        yes,
        f"Requests waited at full occupancy in only {share:.1%} of {s.unit} and the queue P99 is "
        f"{_seconds(queue)}: concurrency is not held back.",
    )


def _at_peaks(s: Samples) -> np.ndarray:
    """Each worker's samples within 5% of its own highest memory peak."""
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
    ask = Question(
        "memory",
        "Does the memory peak cap the batch?",
        t,
        ("memory_peak_to_mean", "kv_nearly_full", "min_samples"),
        {
            "kind": "bar",
            "labels": ["preemptions while a long prefill ran", "other preemptions"],
            "values": [aligned, float(pre.sum()) - aligned],
            "unit": "preemptions",
        },
    )
    if n < t.min_samples or ratio is None:
        return ask.not_enough(n, figures, _too_few_samples(s, t, " (or no memory figures)"))
    if ratio < t.memory_peak_to_mean:
        return ask.no(
            n,
            figures,
            f"Memory peaks at {ratio:.2f}× its mean (threshold {t.memory_peak_to_mean:g}×): the peaks are not "
            "what limits the batch.",
        )
    yes = []
    if kv_at_peaks is not None and kv_at_peaks >= t.kv_nearly_full:
        yes.append(f"At the peaks the KV cache is {kv_at_peaks:.0%} full (threshold {t.kv_nearly_full:.0%}).")
    if aligned > 0:
        yes.append(f"{aligned:.0f} preemptions happened while a long prefill ran.")
    if yes:
        yes.insert(0, f"Memory peaks at {ratio:.2f}× its mean (threshold {t.memory_peak_to_mean:g}×).")
    return ask.judge(
        n,
        figures,
        yes,
        f"Memory peaks at {ratio:.2f}× its mean, but the KV cache has room at the peaks "
        f"({_percent(kv_at_peaks)}) and no preemption lines up with a long prefill.",
    )


# ---- the decode-stall evidence ------------------------------------------------------


def stalls(gaps: Gaps, decode: Decode, t: Thresholds) -> tuple[Stall, Finding]:
    """Do long prefills push the decode gap P99 past the TBT objective (the
    gaps during them past it, the others inside it)? Else whether anything
    else breaks it (the P99 of the other gaps, or of each request's largest
    gap), which chunked prefill alone would not fix."""
    long_p99, other_p99, tbt = gaps.long_prefill_p99_seconds, gaps.other_p99_seconds, decode.tbt_objective_seconds
    ratio = long_p99 / other_p99 if long_p99 is not None and other_p99 else None
    figures = {
        "long_prefill_gap_p99_seconds": long_p99,
        "other_gap_p99_seconds": other_p99,
        "ratio": ratio,
        "stall_p99_seconds": decode.stall_p99_seconds,
        "tbt_objective_seconds": tbt,
        "long_prefill_tokens": gaps.long_prefill_tokens,
        "num_long_prefill_gaps": float(gaps.num_long_prefill),
        "num_other_gaps": float(gaps.num_other),
        "num_stall_requests": float(decode.num_stall_requests),
    }
    long_label = f"> {gaps.long_prefill_tokens:,} tokens" if gaps.long_prefill_tokens else "long"
    bars: list[tuple[str, float | None]] = [
        (f"gap P99 while a prefill {long_label} ran", long_p99),
        ("gap P99 otherwise", other_p99),
        ("each request's largest gap, P99", decode.stall_p99_seconds),
        ("TBT objective", tbt),
    ]
    ask = Question(
        "head_of_line",
        "Do long prefills stall decoding requests past the TBT objective?",
        t,
        ("min_gaps", "min_requests", "hol_ratio"),
        {"kind": "bar", "labels": [b[0] for b in bars], "values": [b[1] for b in bars], "unit": "s"},
        approximate=gaps.approximate,
    )
    approx = " (approximate: from per-request stats)" if gaps.approximate else ""
    enough_long = gaps.num_long_prefill >= t.min_gaps and long_p99 is not None
    enough_other = gaps.num_other >= t.min_gaps and other_p99 is not None
    enough_stall = decode.num_stall_requests >= t.min_requests and decode.stall_p99_seconds is not None
    counts = (
        f"{gaps.num_long_prefill} gaps during long prefills, {gaps.num_other} others, "
        f"{decode.num_stall_requests} requests"
    )
    if not tbt:
        return Stall.UNKNOWN, ask.not_enough(0, figures, "No TBT objective to judge the decode gaps against.")
    # Long prefills push the gaps past the objective only if the gaps without them stay inside it:
    # when those miss it too, no chunking can meet it.
    if enough_other and other_p99 is not None and other_p99 > tbt:
        worse = ""
        if enough_long and ratio is not None and ratio >= t.hol_ratio:
            worse = (
                f" Long prefills make it {ratio:.1f}× worse ({_seconds(long_p99)}; threshold {t.hol_ratio:g}×): "
                "chunking would shorten those stalls, not meet the objective."
            )
        return Stall.OTHER, ask.no(
            gaps.num_other,
            figures,
            f"Decodes miss the TBT objective of {_seconds(tbt)} even while no long prefill runs: the gap P99 is "
            f"{_seconds(other_p99)} then{approx}, so chunked prefill alone cannot meet it.{worse}",
        )
    # A long prefill makes one gap per request decoding beside it, so a short window holds few; the
    # requests' own largest gaps past the objective, while the other gaps stay inside it, corroborate them.
    stall_p99 = decode.stall_p99_seconds
    corroborated = (
        enough_stall and enough_other and gaps.num_long_prefill > 0 and stall_p99 is not None and stall_p99 > tbt
    )
    if (enough_long or corroborated) and long_p99 is not None and long_p99 > tbt:
        few = ""
        if not enough_long:
            few = (
                f" Under {t.min_gaps} such gaps, but each request's largest gap has P99 {_seconds(stall_p99)} over "
                f"{decode.num_stall_requests} requests while the other gaps stay inside the objective: the stalls "
                "are the long prefills'."
            )
        return Stall.LONG_PREFILL, ask.yes(
            gaps.num_long_prefill,
            figures,
            f"While a prefill {long_label} runs, the P99 gap between a decoding request's tokens is "
            f"{_seconds(long_p99)}, past the TBT objective of {_seconds(tbt)} ({gaps.num_long_prefill} gaps); "
            f"otherwise it is {_seconds(other_p99)}{approx}.{few}",
        )
    if enough_stall and stall_p99 is not None and stall_p99 > tbt:
        if gaps.num_long_prefill and not enough_long:
            return Stall.UNKNOWN, ask.not_enough(
                gaps.num_long_prefill,
                figures,
                f"Requests' largest gaps (P99 {_seconds(decode.stall_p99_seconds)}) break the TBT objective of "
                f"{_seconds(tbt)}, but {counts}: too few gaps during long prefills to say whether they are the "
                f"cause (the answer needs {t.min_gaps}){approx}.",
            )
        return Stall.OTHER, ask.no(
            decode.num_stall_requests,
            figures,
            f"Requests' largest gaps (P99 {_seconds(decode.stall_p99_seconds)}) break the TBT objective of "
            f"{_seconds(tbt)}, but not while long prefills run{approx}.",
        )
    if enough_stall or enough_other:
        seen = [
            f"{what} {_seconds(value)}"
            for what, value in (
                ("each request's largest gap has P99", decode.stall_p99_seconds),
                ("the gap P99 during long prefills is", long_p99),
                ("otherwise", other_p99),
            )
            if value is not None
        ]
        return Stall.NONE, ask.no(
            max(decode.num_stall_requests, gaps.num_other),
            figures,
            f"No stall breaks the TBT objective of {_seconds(tbt)}: {', '.join(seen)} ({counts}){approx}.",
        )
    return Stall.UNKNOWN, ask.not_enough(
        gaps.num_long_prefill + gaps.num_other,
        figures,
        f"{counts}; the answer needs {t.min_gaps} gaps or {t.min_requests} requests{approx}.",
    )


# The decode gap P99 is past the objective when more than this share of requests is stalled.
P99_SHARE = 0.01


def prevented(inputs: Inputs, t: Thresholds) -> str:
    """On a chunked pool that does split prompts, the sentence saying its
    chunking is what keeps long prefills off the decodes beside them: more
    than 1% of its successful prompts would each, prefilled whole, take
    longer than the TBT objective, and long prefills did run beside decoding
    requests. Empty when not so."""
    p, e, d = inputs.profile, inputs.engine, inputs.decode
    tbt, spt = d.tbt_objective_seconds, e.prefill_seconds_per_token
    if p is None or p.prefill_mode != "chunked" or not tbt or not spt or inputs.gaps.num_long_prefill <= 0:
        return ""
    if e.max_model_len and min(p.max_num_batched_tokens, p.chunk_cap) >= e.max_model_len:
        return ""  # it never splits: its stalls are monolithic ones, judged as such
    r = inputs.requests
    to_compute = [
        max(0, n - (c or 0))
        for n, c, ok in zip(r.prompt_tokens, r.cached_tokens, r.ok, strict=True)
        if ok and n is not None
    ]
    if len(to_compute) < t.min_requests:
        return ""
    over = sum(n * spt > tbt for n in to_compute)
    share = over / len(to_compute)
    if share <= P99_SHARE:
        return ""
    return (
        f"Run whole, {over} of its {len(to_compute)} prompts ({share:.1%}) would each take longer than the TBT "
        f"objective of {_seconds(tbt)} to prefill (over {int(tbt / spt):,} tokens at {_seconds(spt)} per token), "
        "stalling every request decoding beside them; split, they do not."
    )


# ---- the overall verdict: a decision table ---------------------------------------------


class Questions(StrEnum):
    """What the three questions say together."""

    TWO_YES = "two_yes"
    COULD = "could"  # under two yes, but the unanswered could make two
    NO = "no"  # at most one yes even if every unanswered one said yes


QUESTIONS_TEXT = {
    Questions.TWO_YES: "two or three say yes",
    Questions.COULD: "under two say yes, but the unanswered could make two",
    Questions.NO: "at most one says yes, even counting the unanswered",
}
STALL_TEXT = {
    Stall.LONG_PREFILL: "long prefills push the decode gap P99 past the TBT objective",
    Stall.OTHER: "decodes miss the objective even without long prefills",
    Stall.NONE: "no stall breaks the objective",
    Stall.UNKNOWN: "not enough gaps or requests to say",
    Stall.PREVENTED: "a chunked pool's chunking keeps prompts that would break it, run whole, from stalling decodes",
}


@dataclass(frozen=True)
class Rule:
    stalls: tuple[Stall, ...]
    questions: tuple[Questions, ...]
    overall: Overall
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "stalls": [STALL_TEXT[s] for s in self.stalls],
            "questions": [QUESTIONS_TEXT[q] for q in self.questions],
            "overall": self.overall.value,
            "why": self.why,
        }


ANY_QUESTIONS = (Questions.TWO_YES, Questions.COULD, Questions.NO)
DECISION_TABLE: tuple[Rule, ...] = (
    Rule(
        (Stall.LONG_PREFILL,),
        ANY_QUESTIONS,
        Overall.WORTH_IT,
        "Long prefills push the decode gap P99 past the TBT objective: chunking removes exactly that stall. "
        "The three questions say how much more it gives.",
    ),
    Rule(
        (Stall.PREVENTED,),
        ANY_QUESTIONS,
        Overall.WORTH_IT,
        "This pool's chunking is what keeps long prefills from stalling decodes past the TBT objective: keep it. "
        "The three questions say how much more it gives.",
    ),
    Rule(
        (Stall.NONE, Stall.OTHER, Stall.UNKNOWN),
        (Questions.TWO_YES,),
        Overall.WORTH_IT,
        "Two of the three questions say yes: chunking would pay through them, though long prefills do not "
        "(measurably) stall decodes past the objective today.",
    ),
    Rule(
        (Stall.OTHER,),
        (Questions.COULD, Questions.NO),
        Overall.OTHER_CAUSE,
        "Decodes miss the TBT objective even without long prefills: chunked prefill alone will not meet it "
        "(look at the batch size and capacity first).",
    ),
    Rule(
        (Stall.NONE,),
        (Questions.NO,),
        Overall.NOT_WORTH_IT,
        "No stall breaks the TBT objective and the questions say no: the complexity of chunked prefill may not pay.",
    ),
    Rule(
        (Stall.NONE,),
        (Questions.COULD,),
        Overall.NOT_ENOUGH_DATA,
        "No stall breaks the TBT objective, but the unanswered questions could still make two yes.",
    ),
    Rule(
        (Stall.UNKNOWN,),
        (Questions.COULD, Questions.NO),
        Overall.NOT_ENOUGH_DATA,
        "Too few gaps or requests to say whether long prefills stall decodes, and the questions alone do not "
        "make two yes.",
    ),
)


def questions_say(answers: Sequence[Finding]) -> Questions:
    yes = sum(a.answer == Answer.YES for a in answers)
    unknown = sum(a.answer == Answer.NOT_ENOUGH_DATA for a in answers)
    if yes >= 2:
        return Questions.TWO_YES
    return Questions.COULD if yes + unknown >= 2 else Questions.NO


def rule_for(stall: Stall, questions: Questions) -> int:
    """The index of the one row of ``DECISION_TABLE`` that matches."""
    return next(i for i, r in enumerate(DECISION_TABLE) if stall in r.stalls and questions in r.questions)


def overall(
    answers: Sequence[Finding], hol: Finding, stall: Stall, prevented: str = ""
) -> tuple[Overall, list[str], int]:
    """The verdict, its reasons (the rule's, then every finding that bears on
    it, each contradicting one with why), and the matching rule's index."""
    said = questions_say(answers)
    index = rule_for(stall, said)
    rule = DECISION_TABLE[index]
    reasons = [rule.why]
    if rule.overall == Overall.WORTH_IT:
        if stall == Stall.LONG_PREFILL:
            reasons.append(hol.reasons[0])
        elif stall == Stall.PREVENTED:
            reasons.append(prevented)
        reasons.extend(f"{a.title} Yes: {a.reasons[0]}" for a in answers if a.answer == Answer.YES)
        reasons.extend(f"{a.title} No: {a.reasons[0]}" for a in answers if a.answer == Answer.NO)
        if stall != Stall.LONG_PREFILL:
            reasons.append(f"{hol.title} {ANSWER_TEXT[hol.answer]}: {hol.reasons[0]}")
    elif rule.overall in (Overall.NOT_WORTH_IT, Overall.OTHER_CAUSE):
        reasons.append(hol.reasons[0])
        why_not = (
            "with no stall past the objective"
            if rule.overall == Overall.NOT_WORTH_IT
            else "while decodes miss it anyway"
        )
        reasons.extend(
            f"{a.title} Yes ({a.reasons[0]}), but one yes alone, {why_not}, does not make chunking pay."
            for a in answers
            if a.answer == Answer.YES
        )
        reasons.extend(a.reasons[0] for a in answers if a.answer == Answer.NO)
    else:
        reasons.append(f"{hol.title} {ANSWER_TEXT[hol.answer]}: {hol.reasons[0]}")
        reasons.extend(f"{a.title} {ANSWER_TEXT[a.answer]}: {a.reasons[0]}" for a in answers)
    return rule.overall, reasons, index


# ---- starting knobs -----------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    chunk_tokens: int | None
    chunk_tokens_high: int | None  # the memory rule's upper bound
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


def running_p90(samples: Samples) -> float | None:
    running = [v for v in samples.running if math.isfinite(v)]
    return percentile(running, 90) if running else None


def knobs(inputs: Inputs, t: Thresholds) -> Knobs:
    """Sarathi-Serve's rule: the largest budget whose step, with the typical
    decode batch (P90 of running requests) plus one chunk, fits the TBT
    objective; then the chunk bounded by memory (its activation peak within
    ¼–⅓ of what is left after weights) and the budget strictly below the
    context, so a long prompt is always split. The short-prompt threshold is
    the median prompt of the successful requests, after its prefix hit."""
    e, p, d = inputs.engine, inputs.profile, inputs.decode
    block = p.block_size if p else 16
    r90 = running_p90(inputs.samples)
    decodes = math.ceil(r90) if r90 is not None else (p.max_num_seqs if p else 0)
    reasons: list[str] = []
    figures: dict[str, float | None] = {
        "tbt_objective_seconds": d.tbt_objective_seconds,
        "prefill_seconds_per_token": e.prefill_seconds_per_token,
        "decode_step_seconds": d.step_seconds,
        "running_p90": r90,
        "device_memory_bytes": e.device_memory_bytes,
        "weight_bytes": e.weight_bytes,
        "activation_bytes_per_token": e.activation_bytes_per_token,
        "max_model_len": e.max_model_len,
    }
    # First, the step time: budget × prefill time per token + a decode step ≤ the TBT objective.
    budget = chunk = None
    tbt, spt, step = d.tbt_objective_seconds, e.prefill_seconds_per_token, d.step_seconds
    if tbt and spt and step is not None:
        if step >= tbt:
            reasons.append(
                f"A decode step alone ({_seconds(step)}, the ITL P50) takes the whole TBT objective "
                f"({_seconds(tbt)}): no budget fits; this takes fewer running requests or faster hardware."
            )
        else:
            budget = _round_down((tbt - step) / spt, block)
            chunk = max(block, budget - decodes)
            reasons.append(
                f"max_num_batched_tokens {budget:,}: the largest whose step ({budget:,} × "
                f"{_seconds(spt)} per token + a {_seconds(step)} decode step) fits the TBT objective of "
                f"{_seconds(tbt)}, with one chunk of {chunk:,} beside the {decodes} running decodes (P90)."
            )
    else:
        reasons.append(
            "No step-time rule: it needs the TBT objective, the measured prefill time per token and the decode "
            "step time (ITL P50)."
        )
    # Then memory: the chunk's prefill activation peak within ¼–⅓ of what is left after weights.
    chunk_high = None
    if e.device_memory_bytes and e.weight_bytes is not None and e.activation_bytes_per_token:
        left = max(0.0, e.device_memory_bytes - e.weight_bytes)
        figures["memory_after_weights_bytes"] = left
        low = _round_down(left * t.activation_share_low / e.activation_bytes_per_token, block)
        chunk_high = _round_down(left * t.activation_share_high / e.activation_bytes_per_token, block)
        if chunk is None or chunk > chunk_high:
            chunk = chunk_high if chunk is not None else low
            reasons.append(
                f"A chunk of {chunk:,} tokens keeps the prefill activation peak "
                f"({e.activation_bytes_per_token:,.0f} bytes per token, measured) within "
                f"{t.activation_share_low:.0%}–{t.activation_share_high:.0%} of the {_gib(left)} left after weights "
                f"({low:,}–{chunk_high:,} tokens)."
            )
        else:
            reasons.append(
                f"The memory rule allows up to {chunk_high:,} tokens per chunk ({t.activation_share_high:.0%} of the "
                f"{_gib(left)} left after weights): the step time is the tighter bound."
            )
    elif chunk is None:
        reasons.append(
            "No chunk size: the workers do not report their memory after weights and activation per token yet."
        )
    # Last, strictly below the context, so that a prompt of max_model_len is split.
    if chunk is not None:
        budget = chunk + decodes if budget is None else min(budget, chunk + decodes)
        if e.max_model_len and budget >= e.max_model_len:
            budget = max(block, e.max_model_len - block)
            chunk = max(block, min(chunk, budget - decodes))
            reasons.append(
                f"Capped at {budget:,} tokens, strictly below the {e.max_model_len:,}-token context, so the "
                "longest prompt is still split."
            )
    # The short-prompt threshold: successful requests only (a refused one has no length).
    to_compute = [
        max(0, n - (c or 0))
        for n, c, ok in zip(
            inputs.requests.prompt_tokens, inputs.requests.cached_tokens, inputs.requests.ok, strict=True
        )
        if ok and n is not None
    ]
    short = None
    median = percentile(to_compute, 50)
    if median is not None:
        short = max(block, int(math.ceil(median / block) * block))
        if chunk is not None:
            short = min(short, chunk)
        reasons.append(
            f"short_prompt_threshold {short:,}: half the successful requests have at most {median:.0f} prompt "
            "tokens left to compute after their prefix-cache hit, and those run whole, never split."
        )
    figures["median_tokens_to_compute"] = median
    seats = p.max_num_seqs if p else None
    return Knobs(chunk, chunk_high, short, budget, seats, reasons, figures)


# ---- is a chunked pool tuned right? ------------------------------------------------------


def chunk_too_small(inputs: Inputs, t: Thresholds) -> Finding:
    pool, base = inputs.pool, inputs.baseline
    ask = Question(
        "chunk_too_small",
        "Is the chunk too small?",
        t,
        ("chunk_too_small_drop", "min_requests"),
        knob="long_prefill_token_threshold",
        direction="raise",
    )
    if pool is None or base is None:
        return ask.not_enough(
            pool.num_requests if pool else 0, {}, "No stable or monolithic baseline to compare throughput with."
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
        return ask.not_enough(
            n, figures, f"{n} requests on the smaller side; the answer needs {t.min_requests} and both throughputs."
        )
    drop = 1 - pool.output_tokens_per_second_per_worker / base.output_tokens_per_second_per_worker
    figures["throughput_drop"] = drop
    improved = pool.stall_p99_seconds < base.stall_p99_seconds
    yes = []
    if drop > t.chunk_too_small_drop and improved:
        yes.append(
            f"Throughput per worker is {drop:.0%} below {base.name or 'the baseline'} (threshold "
            f"{t.chunk_too_small_drop:.0%}) while stalls improved: raise the chunk size "
            "(long_prefill_token_threshold)."
        )
    return ask.judge(
        n,
        figures,
        yes,
        f"Throughput per worker is within {t.chunk_too_small_drop:.0%} of "
        f"{base.name or 'the baseline'} ({-drop:+.0%}), or stalls did not improve.",
    )


def budget_too_large(inputs: Inputs, stall: Stall, knobs: Knobs, t: Thresholds) -> Finding:
    """Judged on the pool alone, never against another pool: a budget and
    chunk cap that cover the whole context never split anything; else the
    step a full budget implies (prefill time per token × budget + a decode
    step) against the TBT objective; without step times, the stall evidence."""
    p, e, d = inputs.profile, inputs.engine, inputs.decode
    ask = Question(
        "budget_too_large",
        "Is the budget too large?",
        t,
        ("budget_step_over_tbt",),
        knob="max_num_batched_tokens",
        direction="lower",
    )
    if p is None:
        return ask.not_enough(0, {}, "No profile known for this pool.")
    n = len(inputs.requests.created)
    largest = min(p.max_num_batched_tokens, p.chunk_cap)
    figures: dict[str, float | None] = {
        "max_num_batched_tokens": p.max_num_batched_tokens,
        "chunk_cap": p.chunk_cap,
        "max_model_len": e.max_model_len,
        "prefill_seconds_per_token": e.prefill_seconds_per_token,
        "decode_step_seconds": d.step_seconds,
        "tbt_objective_seconds": d.tbt_objective_seconds,
    }
    lower_to = (
        f" Lower it (the advisor's start: {knobs.max_num_batched_tokens:,})."
        if knobs.max_num_batched_tokens
        else " Lower it."
    )
    if e.max_model_len and largest >= e.max_model_len:
        return ask.yes(
            n,
            figures,
            f"Not chunking: the budget ({p.max_num_batched_tokens:,}) and chunk cap ({p.chunk_cap:,}) are at or "
            f"above the {e.max_model_len:,}-token context, so no prompt is ever split; this pool runs "
            f"monolithic prefill under another name.{lower_to}",
        )
    tbt, spt, step = d.tbt_objective_seconds, e.prefill_seconds_per_token, d.step_seconds
    if tbt and spt and step is not None:
        implied = spt * p.max_num_batched_tokens + step
        figures["budget_step_seconds"] = implied
        sentence = (
            f"A full step of {p.max_num_batched_tokens:,} tokens takes about {_seconds(implied)} "
            f"({_seconds(spt)} per prefill token + a {_seconds(step)} decode step) against the TBT objective of "
            f"{_seconds(tbt)}"
        )
        if implied > tbt * t.budget_step_over_tbt:
            return ask.yes(n, figures, f"{sentence}: every full step stalls the decodes beside it.{lower_to}")
        return ask.no(n, figures, f"{sentence}: the budget fits.")
    if stall == Stall.LONG_PREFILL:
        return ask.yes(
            n,
            figures,
            f"No step times measured, but chunking is on and long prefills still push the decode gap P99 past "
            f"the TBT objective.{lower_to}",
        )
    if stall in (Stall.NONE, Stall.OTHER):
        return ask.no(
            n, figures, "No step times measured, and long prefills do not push decodes past the TBT objective."
        )
    return ask.not_enough(n, figures, "No step times measured and too few decode gaps to judge the budget by.")


def long_starved(requests: Requests, long: LongPrompt, t: Thresholds) -> Finding:
    """Long prompts starved: their TTFT P50 per prompt token against short prompts'."""
    ask = Question(
        "long_starved",
        "Do short prompts starve long ones?",
        t,
        ("starvation_ratio", "long_prompt_context_share", "long_prompt_chunks", "min_requests"),
        knob="min_prefill_tokens_per_step",
        direction="raise",
    )
    rows = _timed(requests, long)
    if rows is None:
        return ask.not_enough(0, {}, long.basis)
    lengths, ttft, is_long, is_short, _ = rows
    n = int(min(is_long.sum(), is_short.sum()))
    if n < 1 or is_short.sum() + is_long.sum() < t.min_requests:
        return ask.not_enough(
            n,
            {"long_prompt_tokens": long.tokens},
            f"{int(is_long.sum())} long and {int(is_short.sum())} short requests (long: over {long.tokens:,} tokens); "
            f"the answer needs some of each and {t.min_requests} in all.",
        )
    long_rate = float(np.median(ttft[is_long] / np.maximum(lengths[is_long], 1)))
    short_rate = float(np.median(ttft[is_short] / np.maximum(lengths[is_short], 1)))
    ratio = long_rate / short_rate if short_rate > 0 else math.inf
    figures = {
        "long_prompt_tokens": long.tokens,
        "long_ttft_per_token_seconds": long_rate,
        "short_ttft_per_token_seconds": short_rate,
        "ratio": ratio,
    }
    yes = []
    if ratio >= t.starvation_ratio:
        yes.append(
            f"Long prompts (over {long.tokens:,} tokens) wait {ratio:.1f}× longer per prompt token for their first "
            f"token than short ones (threshold {t.starvation_ratio:g}×): raise min_prefill_tokens_per_step."
        )
    return ask.judge(n, figures, yes, f"Long prompts' first token per prompt token is {ratio:.1f}× short ones'.")


def short_starved(requests: Requests, long: LongPrompt, t: Thresholds) -> Finding:
    """Short prompts starved: their TTFT while a long prompt was prefilling
    (arrived between its arrival and first token) against otherwise."""
    ask = Question(
        "short_starved",
        "Do long prompts starve short ones?",
        t,
        ("starvation_ratio", "long_prompt_context_share", "long_prompt_chunks", "min_requests"),
        knob="long_prefill_token_threshold",
        direction="lower",
    )
    rows = _timed(requests, long)
    if rows is None:
        return ask.not_enough(0, {}, long.basis)
    _, ttft, is_long, is_short, created = rows
    during = np.zeros(len(created), dtype=bool)
    for a, b in zip(created[is_long].tolist(), (created[is_long] + ttft[is_long]).tolist(), strict=True):
        during |= (created > a) & (created < b)
    hit, rest = is_short & during, is_short & ~during
    n = int(min(hit.sum(), rest.sum()))
    if n < 1 or is_short.sum() < t.min_requests:
        return ask.not_enough(
            n,
            {"long_prompt_tokens": long.tokens},
            f"{int(hit.sum())} short requests arrived during a long prefill, {int(rest.sum())} "
            f"otherwise; the answer needs some of each and {t.min_requests} short ones.",
        )
    during_p99 = percentile(ttft[hit].tolist(), 99) or 0.0
    other_p99 = percentile(ttft[rest].tolist(), 99) or 0.0
    ratio = during_p99 / other_p99 if other_p99 > 0 else math.inf
    figures = {
        "long_prompt_tokens": long.tokens,
        "short_ttft_p99_during_long_seconds": during_p99,
        "short_ttft_p99_otherwise_seconds": other_p99,
        "ratio": ratio,
    }
    yes = []
    if ratio >= t.starvation_ratio:
        yes.append(
            f"Short prompts arriving during a long prefill wait {ratio:.1f}× longer for their first "
            f"token (P99 {_seconds(during_p99)} against {_seconds(other_p99)}; threshold "
            f"{t.starvation_ratio:g}×): lower the chunk cap (long_prefill_token_threshold)."
        )
    return ask.judge(n, figures, yes, f"Short prompts' TTFT P99 during long prefills is {ratio:.1f}× the rest.")


def _timed(
    requests: Requests, long: LongPrompt
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Lengths, TTFTs, long and short masks (successful, timed rows) and arrivals."""
    if long.tokens is None:
        return None
    created = np.asarray(requests.created, dtype=np.float64)
    lengths = np.asarray([math.nan if n is None else n for n in requests.prompt_tokens], dtype=np.float64)
    ttft = np.asarray([math.nan if v is None else v for v in requests.ttft_seconds], dtype=np.float64)
    ok = np.asarray(requests.ok, dtype=bool) & ~np.isnan(ttft) & ~np.isnan(lengths)
    with np.errstate(invalid="ignore"):
        return lengths, ttft, ok & (lengths > long.tokens), ok & (lengths <= long.tokens), created


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
    bandwidth = t.link_bandwidth_gbps * 1e9
    figures: dict[str, float | None] = {
        "kv_bytes_per_token": kv_bytes,
        "prefill_seconds_per_token": prefill_seconds_per_token,
    }
    ask = Question(
        "pd",
        "Would prefill-decode disaggregation pay? (an estimate, not a measurement)",
        t,
        ("link_bandwidth_gbps", "pd_max_transfer_share"),
        {"formula": PD_FORMULA},
    )
    if not kv_bytes or not prefill_seconds_per_token:
        return ask.not_enough(
            0, figures, "No KV bytes per token or measured prefill time per token from the workers yet."
        )
    transfer = kv_bytes / bandwidth
    share = transfer / prefill_seconds_per_token
    figures.update({"transfer_seconds_per_token": transfer, "transfer_share": share})
    computed = (
        f"({kv_bytes:,.0f} B/token ÷ {t.link_bandwidth_gbps:g} GB/s) ÷ {prefill_seconds_per_token * 1e6:.3g} µs/token"
        f" = {transfer * 1e9:.3g} ns ÷ {prefill_seconds_per_token * 1e9:.3g} ns = {share:.3g}"
    )
    ask = replace(ask, chart={"formula": PD_FORMULA, "computed": computed})
    if share > t.pd_max_transfer_share:
        return ask.no(
            1,
            figures,
            f"Moving a token's KV takes {share:.1%} of its prefill time (threshold {t.pd_max_transfer_share:.0%}):"
            " the transfer costs about as much as the interference it removes (estimate).",
        )
    if hol.answer != Answer.YES:
        return ask.no(
            1,
            figures,
            f"The transfer is cheap ({share:.1%} of the prefill time) but long prefills do not stall decodes "
            "past the TBT objective, so there is little interference to remove (estimate).",
        )
    return ask.yes(
        1,
        figures,
        f"Moving a token's KV takes {share:.1%} of the time its prefill stalls decodes (threshold "
        f"{t.pd_max_transfer_share:.0%}), and long prefills do stall decodes here: a PD route would "
        "likely pay (estimate).",
    )


PD_DATABASE_METHOD = (
    "AIConfigurator's database (aiconfigurator-core): aggregated chunked serving from its own sweep; "
    "disaggregated from its prefill and decode worker models, rate-matched per GPU, the prefill's TTFT "
    "plus the prompt's KV over the link"
)


def pd_database(est: PdDatabase | None, formula: Finding, t: Thresholds) -> Finding:
    """Disaggregated against aggregated chunked serving, tokens/s per GPU under
    the objectives, from the database; the formula (``pd_estimate``) beside it."""
    ask = Question(
        "pd_database",
        "Would prefill-decode disaggregation pay on this GPU and model? (an estimate from the database)",
        t,
        ("pd_min_gain", "link_bandwidth_gbps"),
    )
    cross_check = f"The formula's cross-check above says {formula.answer.value.replace('_', ' ')}."
    if est is None:
        return ask.not_enough(0, {}, "Not estimated for this report.", cross_check)
    agg, disagg = est.agg_tokens_per_second_per_gpu, est.disagg_tokens_per_second_per_gpu
    gain = disagg / agg if agg and disagg is not None else None
    figures: dict[str, float | None] = {
        "agg_tokens_per_second_per_gpu": agg,
        "disagg_tokens_per_second_per_gpu": disagg,
        "disagg_over_agg": gain,
        "sweep_seconds": est.sweep_seconds,
    }
    ask = replace(ask, chart={"formula": PD_DATABASE_METHOD, "estimate": asdict(est)})
    if est.unavailable:
        return ask.not_enough(0, figures, f"No database estimate: {est.unavailable}", cross_check)
    where = (
        f"{est.inputs.get('model')} on {est.inputs.get('system')} ({est.inputs.get('backend')} "
        f"{est.inputs.get('database_version')}), prompts {est.inputs.get('isl')} and outputs "
        f"{est.inputs.get('osl')} tokens"
    )
    if agg is None and disagg is None:
        return ask.not_enough(
            1, figures, f"No configuration meets the TTFT and TPOT objectives for {where}, either way.", cross_check
        )
    if agg is None or (gain is not None and gain >= t.pd_min_gain):
        said = "aggregated cannot meet them" if agg is None else f"{gain:.2f}× aggregated chunked serving"
        return ask.yes(
            1,
            figures,
            f"Disaggregated serving estimates {disagg:,.0f} tokens/s per GPU under the objectives, {said}, "
            f"for {where} (estimate from the database).",
            cross_check,
        )
    said = "cannot meet the objectives" if disagg is None else f"gives {gain:.2f}× (threshold {t.pd_min_gain:g}×)"
    return ask.no(
        1,
        figures,
        f"Aggregated chunked serving estimates {agg:,.0f} tokens/s per GPU under the objectives; "
        f"disaggregated {said}, for {where} (estimate from the database).",
        cross_check,
    )


# ---- prefix hits per length bucket ----------------------------------------------------------


def prefix_hits_by_bucket(requests: Requests) -> dict[str, Any]:
    """Cached prompt tokens over prompt tokens per length bucket, from the
    gateway log's cached tokens (rows where the gateway learnt them)."""
    prompt: dict[str, int] = {}
    cached: dict[str, int] = {}
    known = 0
    for n, c in zip(requests.prompt_tokens, requests.cached_tokens, strict=True):
        if c is None or n is None:
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
    rule: int  # the matching row of DECISION_TABLE
    stall: Stall
    long_prompt: LongPrompt
    questions: list[Finding]
    head_of_line: Finding
    knobs: Knobs
    tuning: list[Finding]  # empty unless the pool runs chunked
    pd: Finding
    prefix_hits: dict[str, Any]
    pd_database: Finding | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "overall": self.overall.value,
            "overall_reasons": self.overall_reasons,
            "decision": {
                "rule": self.rule,
                "stall": self.stall.value,
                "table": [r.to_json() for r in DECISION_TABLE],
            },
            "long_prompt": asdict(self.long_prompt),
            "questions": [q.to_json() for q in self.questions],
            "head_of_line": self.head_of_line.to_json(),
            "knobs": self.knobs.to_json(),
            "tuning": [f.to_json() for f in self.tuning],
            "pd": self.pd.to_json(),
            "pd_database": self.pd_database.to_json() if self.pd_database else None,
            "prefix_hits": self.prefix_hits,
        }


def advise(inputs: Inputs, t: Thresholds) -> Report:
    long = long_prompt(inputs, t)
    questions = [long_tail(inputs.requests, long, t), concurrency(inputs, t), memory(inputs, t)]
    stall, hol = stalls(inputs.gaps, inputs.decode, t)
    kept_off = prevented(inputs, t) if stall != Stall.LONG_PREFILL else ""
    if kept_off:
        stall = Stall.PREVENTED
    verdict, reasons, rule = overall(questions, hol, stall, kept_off)
    start = knobs(inputs, t)
    tuning: list[Finding] = []
    if inputs.profile is not None and inputs.profile.prefill_mode == "chunked":
        tuning = [
            chunk_too_small(inputs, t),
            budget_too_large(inputs, stall, start, t),
            long_starved(inputs.requests, long, t),
            short_starved(inputs.requests, long, t),
        ]
        if verdict != Overall.WORTH_IT and any(f.answer == Answer.YES for f in tuning):
            reasons.append(
                "The tuning findings below say how to make this pool's chunking do its job should it stay "
                "chunked; they do not make chunking needed for this traffic."
            )
    pd = pd_estimate(inputs.engine.kv_bytes_per_token, inputs.engine.prefill_seconds_per_token, hol, t)
    return Report(
        verdict,
        reasons,
        rule,
        stall,
        long,
        questions,
        hol,
        start,
        tuning,
        pd,
        prefix_hits_by_bucket(inputs.requests),
        pd_database(inputs.pd_database, pd, t),
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "unknown"
    if value < 1e-3:
        return f"{value * 1e6:.3g} µs"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _percent(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"
