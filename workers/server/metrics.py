"""The worker's ``/metrics``: the metric vocabulary ("Metrics" in
docs/architecture.md), fed by engine records.

One exporter serves both engines with identical names. It observes the engine
through ``EngineObserver`` (``on_step``, ``on_request_finished``) and reads
``engine.load()`` at scrape time, so gauges are current even when no step has
run since an abort freed blocks.

* ``chunkpilot:*`` — always computed here, from the records. The
  client-facing latencies (TTFT, ITL, TPOT, the largest gap per request) are
  measured where the user sees them: for a streamed request from the times
  the server wrote each SSE event (``observe_delivered``, called by the
  server when a stream ends); for a whole reply from the engine's token
  times. The engine's own production times stay, named as such
  (``chunkpilot:engine_request_max_gap_seconds``), beside the delivery
  health (merged deltas, delivery lag).
* Head-of-line blocking (``chunkpilot:decode_gap_*``) is accounted per
  request, as delivered: each pair of consecutive tokens of one request is a gap, "long"
  if a step that ran a prefill of more than ``long_prefill_tokens`` (relative
  to the model's context, ``figures.long_prefill_tokens``) overlapped it.
  Time before a request's first token and idle time are never gaps.
* ``vllm:*`` — for an engine with its own Prometheus metrics (the vLLM backend
  exposes ``prometheus_collector()``), vLLM's own families are served as they
  are; for any other engine (the reference engine) they are computed here
  from the records, with vLLM 0.32's names, labels (``model_name``,
  ``engine``) and bucket boundaries, so one dashboard and one rule file read
  both.

Counters live in the exporter, not the engine, so they survive a profile
switch (which rebuilds the engine). vLLM's own counters restart with a new
engine, as a restarted vLLM server's would; ``rate()`` treats that as a reset.

Time-weighted figures are sample-and-hold: a step's fragmentation and memory
hold until the next step, and the ``*_seconds_total`` counters integrate them
up to the moment of the scrape.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from workers import figures
from workers.engines import stream
from workers.engines.api import EngineLoad, RequestMetrics, StepMetrics
from workers.profile import EngineProfile

# ``*_created`` series double the count of series and nothing reads them; the
# switch is process-wide, so vLLM's own metrics lose them too (as its server does).
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name", "engine"]
RECENT_PEAK_WINDOW_SECONDS = 15.0

# vLLM 0.32's bucket boundaries (vllm/v1/metrics/buckets.py), so histograms of
# both engines aggregate bucket by bucket.
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Chunkpilot's own latencies: log-spaced, 4 per doubling from 0.5 ms
# (workers/figures.py:fine_buckets), so a 2-ms ITL or a 70-ms TTFT is
# resolved instead of interpolated inside a bucket from 0 to 10 ms or from
# 60 to 80 ms. Gaps, ITL and TPOT to 131 s; TTFT and prefill time to 70 min.
FINE_LATENCY_BUCKETS = figures.fine_buckets(80.0)
FINE_TTFT_BUCKETS = figures.fine_buckets(2560.0)
# The former coarse stall buckets; the gateway's own histograms still use them.
MAX_GAP_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
CHUNK_WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _Peak(NamedTuple):
    at: float  # when its step ended, engine clock
    memory_bytes: int


def request_token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series up to the model's length (``request_tokens``)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class _FamilyFilter:
    """The families of another collector that ``keep`` accepts."""

    def __init__(self, source: Any, keep: Callable[[Metric], bool]):
        self.source, self.keep = source, keep

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if self.keep(family):
                yield family


def _named(names: frozenset[str]) -> Callable[[Metric], bool]:
    """A family named in ``names``, by its own name or one of its samples'
    (``…_bucket``)."""
    return lambda family: family.name in names or any(s.name in names for s in family.samples)


class _Concat:
    def __init__(self, *sources: Any):
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            yield from source.collect()


BY_PROMPT_TTFT = "chunkpilot:time_to_first_token_by_prompt_seconds"
BY_PROMPT_MAX_GAP = "chunkpilot:request_max_gap_by_prompt_seconds"
BY_PROMPT_PREFILL = "chunkpilot:request_prefill_time_by_prompt_seconds"
BY_PROMPT_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    (
        BY_PROMPT_TTFT,
        "Time to first token as delivered (its SSE event written), by the request's prompt-length bucket.",
        FINE_TTFT_BUCKETS,
    ),
    (
        BY_PROMPT_MAX_GAP,
        "Per finished request, its largest gap between two token events as written, by prompt-length bucket.",
        FINE_LATENCY_BUCKETS,
    ),
    (BY_PROMPT_PREFILL, "First scheduled to first token (engine), by prompt-length bucket.", FINE_TTFT_BUCKETS),
)
# Long-prefill steps are remembered this long (engine clock), for the gaps of
# requests still running; a gap older than that is counted as "other".
LONG_STEP_MEMORY_SECONDS = 3600.0
LONG_STEP_MEMORY_COUNT = 100_000
# A step overlaps a gap only by more than this: the step that produced the
# gap's first token ends exactly at it (float noise aside).
OVERLAP_EPSILON_SECONDS = 1e-6


class _LongSteps:
    """The (start, end) of recent steps that ran a long prefill, in order of
    their end, for telling each request's gaps apart: added on the engine
    thread, read on the server's event loop."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self.starts.append(start)
            self.ends.append(end)
            cut = max(bisect_left(self.ends, end - LONG_STEP_MEMORY_SECONDS), len(self.ends) - LONG_STEP_MEMORY_COUNT)
            if cut > 0:
                del self.starts[:cut], self.ends[:cut]

    def flags(self, times: Sequence[float]) -> list[bool]:
        """For each gap between consecutive ``times``, whether a long-prefill step overlapped it."""
        with self._lock:
            return [self._overlaps(a, b) for a, b in zip(times, times[1:], strict=False)]

    def _overlaps(self, a: float, b: float) -> bool:
        i = bisect_right(self.ends, a + OVERLAP_EPSILON_SECONDS)  # the first step ending after a
        # Steps end in order and start in order, so the first one ending after
        # ``a`` is the first candidate; later ones start no earlier.
        while i < len(self.ends) and self.starts[i] < b - OVERLAP_EPSILON_SECONDS:
            if min(self.ends[i], b) - max(self.starts[i], a) > OVERLAP_EPSILON_SECONDS:
                return True
            i += 1
        return False


# ---- the page, rendered once per change -------------------------------------------
# A worker's page is ~2,300 lines, most of them histogram buckets that no
# request touched since the last scrape; prometheus_client's generic
# exposition formats every one of them every 5 s (~18 ms a page), which at
# hundreds of simulated workers per machine was the machine's whole budget.
# The exporter's own families keep their text and re-format only the children
# written since (a histogram child's lines after an observe); prometheus_client
# stays the store and the format's author: a child's values are read from it
# (``_child_samples()``; a histogram's bucket counts summed as that method sums
# them) and printed after the line prefixes that ``generate_latest`` rendered
# for that child once. The output is byte for byte the generic one
# (tests/workers/server/test_metrics_page.py).


class _Families:
    """Metric families as a collector, for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


class _Cached(MetricWrapperBase):
    """A Counter, Gauge or Histogram (mixed in before it) that keeps its text.

    A write marks its child stale after the value lands; a render clears the
    mark before it reads the values, so a write that races a render is
    rendered next time, never lost. Renders of one exporter hold its lock.
    ``num_renders`` counts the family's re-renders (and a child's its own)."""

    _stale = True
    _prefixes: tuple[str, ...] = ()
    _lines = ""
    _children: tuple[_Cached, ...] = ()
    _text = b""
    _header = ""
    num_renders = 0

    def _changed(self) -> None:
        self._stale = True

    def exposition(self) -> bytes:
        """The family's text, as ``generate_latest`` of this metric alone would print it."""
        children: tuple[_Cached, ...] = (self,)
        if self._is_parent():
            with self._lock:
                children = tuple(cast("dict[Any, _Cached]", self._metrics).values())
        changed = children != self._children
        for child in children:
            if child._stale:
                child._render_lines()
                changed = True
        if changed or not self._header:
            if not self._header:
                self._header = generate_latest(_Families(self.describe())).decode()
            self._children = children
            self._text = (self._header + "".join(child._lines for child in children)).encode()
            self.num_renders += 1
        return self._text

    def named(self, names: frozenset[str]) -> bool:
        """Whether ``_named(names)`` keeps this family (the ``?name[]=`` filter)."""
        if self._name in names:
            return True
        has_samples = not self._is_parent() or bool(self._metrics)
        suffixes = _SAMPLE_SUFFIXES.get(self._type or "", ())
        return has_samples and any(self._name + suffix in names for suffix in suffixes)

    def _render_lines(self) -> None:
        self._stale = False
        values = self._value_texts()
        if len(values) != len(self._prefixes):
            self._prefixes = self._line_prefixes(tuple(self._child_samples()))
        self._lines = "".join([f"{prefix}{value}\n" for prefix, value in zip(self._prefixes, values, strict=True)])
        self.num_renders += 1

    def _value_texts(self) -> list[str]:
        """The child's sample values as its exposition prints them, in its order."""
        return [floatToGoString(s.value) for s in self._child_samples()]

    def _line_prefixes(self, samples: Sequence[Sample]) -> tuple[str, ...]:
        """Each sample's line up to its value, as prometheus_client prints it."""
        family = next(iter(self.describe()))
        labels = dict(zip(self._labelnames, self._labelvalues, strict=True))
        for s in samples:
            family.add_sample(self._name + s.name, {**labels, **s.labels}, s.value)
        lines = generate_latest(_Families([family])).decode().splitlines()[2:]  # after HELP and TYPE
        return tuple(line.rpartition(" ")[0] + " " for line in lines)


# The sample names of a family, by type (``_created`` is off: ``disable_created_metrics`` above).
_SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


class CachedHistogram(_Cached, Histogram):
    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        super().observe(amount, exemplar)
        self._changed()

    def _value_texts(self) -> list[str]:
        # ``Histogram._child_samples`` without its Sample objects and ``le``
        # labels (two thirds of a re-render): the cumulative bucket counts,
        # the count, the sum. A count's text is looked up: a page repeats a
        # few dozen of them.
        texts = _COUNT_TEXTS
        if len(texts) >= _MAX_NUM_COUNT_TEXTS:
            texts.clear()
        out: list[str] = []
        count = 0.0
        for bucket in self._buckets:
            count += bucket.get()
            text = texts.get(count)
            if text is None:
                text = texts[count] = floatToGoString(count)
            out.append(text)
        out.append(out[-1])
        if self._upper_bounds[0] >= 0:
            out.append(floatToGoString(self._sum.get()))
        return out


# Bucket counts' texts (whole numbers from 0 up: never NaN, never -0.0, so a float key is safe).
_COUNT_TEXTS: dict[float, str] = {}
_MAX_NUM_COUNT_TEXTS = 100_000


class CachedCounter(_Cached, Counter):
    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        super().inc(amount, exemplar)
        self._changed()

    def reset(self) -> None:
        super().reset()
        self._changed()


class CachedGauge(_Cached, Gauge):
    def inc(self, amount: float = 1) -> None:
        super().inc(amount)
        self._changed()

    def dec(self, amount: float = 1) -> None:
        super().dec(amount)
        self._changed()

    def set(self, value: float) -> None:
        super().set(value)
        self._changed()


class _Registry(CollectorRegistry):
    """A registry that lists its collectors in the order it collects them."""

    def __init__(self, auto_describe: bool = False):
        super().__init__(auto_describe=auto_describe)
        self.collectors: list[Any] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


_CACHED_TYPES = frozenset({CachedHistogram, CachedCounter, CachedGauge})


def _exposition(collector: Any, names: frozenset[str]) -> bytes:
    if type(collector) in _CACHED_TYPES:  # (isinstance goes through Collector's Protocol check: slower)
        return collector.exposition() if not names or collector.named(names) else b""
    return generate_latest(_FamilyFilter(collector, _named(names)) if names else collector)


class MetricsExporter:
    def __init__(self, *, model_name: str, max_model_len: int, clock: Callable[[], float] = time.monotonic):
        self.model_name = model_name
        self.clock = clock
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._labels = (model_name, "0")
        self._load: Callable[[], EngineLoad] | None = None
        self._native: Any = None  # the engine's own vllm:* registry, when it has one
        self._engine: Any = None
        self.max_model_len = max_model_len
        self.long_prefill_tokens = figures.long_prefill_tokens(max_model_len)

        # ---- chunkpilot:* -----------------------------------------------
        self.registry = _Registry(auto_describe=True)
        r = self.registry

        def fine(name: str, doc: str, buckets: tuple[float, ...] = FINE_LATENCY_BUCKETS) -> Any:
            return CachedHistogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self._labels)

        # What the client sees: from the written SSE events (a whole reply: the engine's token times).
        self.ttft = fine(
            "chunkpilot:time_to_first_token_seconds",
            "Per finished request, arrival to its first token as delivered (the first content event written).",
            FINE_TTFT_BUCKETS,
        )
        self.itl = fine(
            "chunkpilot:inter_token_latency_seconds",
            "Per output token after the first, the time since the previous one as delivered "
            "(tokens merged into one event share its write time).",
        )
        self.tpot = fine(
            "chunkpilot:request_time_per_output_token_seconds",
            "Per finished request, (last token - first token) / (tokens - 1) as delivered.",
        )
        self.max_gap = fine(
            "chunkpilot:request_max_gap_seconds",
            "Per finished request, its largest gap between two token events as written: the user's stall.",
        )
        # The engine's own production times and the delivery's health.
        self.engine_max_gap = fine(
            "chunkpilot:engine_request_max_gap_seconds",
            "Per finished request, its largest gap between two tokens as the engine produced them.",
        )
        self.delivery_lag = fine(
            "chunkpilot:delivery_lag_seconds",
            "Per written SSE event, its write time minus the engine's production time of its newest token.",
        )
        # The latencies a prompt's length drives, per prompt-length bucket
        # (workers/figures.py:PROMPT_BUCKETS), so per-bucket figures cover the
        # engines' own histograms too. Every bucket's series exists from the
        # start, so a scrape's layout does not change when a new length shows up.
        self.by_prompt = {
            name: CachedHistogram(name, doc, [*LABELS, "prompt_bucket"], buckets=buckets, registry=r)
            for name, doc, buckets in BY_PROMPT_HISTOGRAMS
        }
        for histogram in self.by_prompt.values():
            for bucket, _ in figures.PROMPT_BUCKETS:
                histogram.labels(*self._labels, bucket)
        self.chunk_wait = CachedHistogram(
            "chunkpilot:prefill_chunk_wait_seconds",
            "Per prefill chunk, how long its request waited, schedulable, before it ran.",
            LABELS,
            buckets=CHUNK_WAIT_BUCKETS,
            registry=r,
        ).labels(*self._labels)
        self.step_tokens = CachedCounter(
            "chunkpilot:step_tokens", "Tokens run by engine steps, by kind.", [*LABELS, "kind"], registry=r
        )
        self.steps = CachedCounter("chunkpilot:steps", "Engine steps.", LABELS, registry=r).labels(*self._labels)
        # Head-of-line blocking, per request: the gap between two consecutive
        # tokens of one request as delivered (written times; a whole reply's
        # engine times), split by whether a step that ran a long prefill
        # overlapped it (engines whose steps say so: StepMetrics.max_prefill_tokens).
        # Observed when the request's response ends.
        self.gap_long = fine(
            "chunkpilot:decode_gap_long_prefill_seconds",
            "Per pair of consecutive tokens of one request as delivered, the gap between them when a step with "
            "a prefill of more than chunkpilot:long_prefill_tokens tokens ran during it.",
        )
        self.gap_other = fine(
            "chunkpilot:decode_gap_other_seconds",
            "Per pair of consecutive tokens of one request as delivered, the gap between them when no long prefill "
            "ran during it.",
        )
        self.long_prefill_steps = CachedCounter(
            "chunkpilot:long_prefill_steps",
            "Engine steps during which a prefill of more than chunkpilot:long_prefill_tokens tokens ran.",
            LABELS,
            registry=r,
        ).labels(*self._labels)
        self.prefill_seconds = CachedCounter(
            "chunkpilot:prefill_seconds",
            "Step time spent on prefill tokens (each step's duration times its prefill share of tokens).",
            LABELS,
            registry=r,
        ).labels(*self._labels)
        self.profile_info = CachedGauge(
            "chunkpilot:profile_info",
            "The engine profile running now (value 1).",
            [*LABELS, "engine_kind", "profile", "revision", "prefill_mode", "budget", "chunk_cap"],
            registry=r,
        )
        r.register(_HeldFigures(self))

        # ---- vllm:* computed from records (engines without their own) -----
        self.vllm_registry = _Registry(auto_describe=True)
        v = self.vllm_registry

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return CachedHistogram(name, doc, LABELS, buckets=list(buckets), registry=v).labels(*self._labels)

        def counter(name: str, doc: str) -> Any:
            return CachedCounter(name, doc, LABELS, registry=v).labels(*self._labels)

        tokens = request_token_buckets(max_model_len)
        self.v_ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.v_itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.v_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.v_e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.v_queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.v_inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.v_prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.v_decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.v_prompt_hist = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.v_gen_hist = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.v_iteration = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.v_prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.v_generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.v_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.v_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.v_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.v_success = CachedCounter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=v,
        )
        v.register(_LoadGauges(self))

        # ---- sample-and-hold state (guarded by _lock) -----------------------
        self._held_since: float | None = None
        self._fragmentation = 0.0
        self._fragmentation_seconds = 0.0
        self._memory_bytes = 0
        self._memory_byte_seconds = 0.0
        self._held_seconds = 0.0  # the time the integrals above cover
        self._recent_peaks: deque[_Peak] = deque()
        # ---- head-of-line state (engine thread) ------------------------------
        self._long_steps = _LongSteps()
        self._steps_say_prefill = False  # a step said what prefill ran (max_prefill_tokens)
        # the largest prefill step seen: its tokens and its transient bytes
        self._activation: tuple[int, int] = (0, 0)

    # ---- wiring --------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Observe a (new) engine; called again after each profile switch,
        which may keep the same engine (a live update): observe it once."""
        if engine is self._engine:
            return
        self._engine = engine
        max_model_len = getattr(engine, "max_model_len", None)
        if isinstance(max_model_len, int) and max_model_len > 0:
            self.max_model_len = max_model_len
            self.long_prefill_tokens = figures.long_prefill_tokens(max_model_len)
        engine.add_observer(self)
        self._load = engine.load
        native = getattr(engine, "prometheus_collector", None)
        self._native = (
            _FamilyFilter(native(), lambda family: family.name.startswith("vllm:")) if native is not None else None
        )

    def set_profile(self, profile: EngineProfile, *, engine_kind: str, name: str, revision: int | str) -> None:
        self.profile_info.clear()
        self.profile_info.labels(
            *self._labels,
            engine_kind,
            name,
            str(revision),
            profile.prefill_mode,
            str(profile.max_num_batched_tokens),
            str(profile.chunk_cap),
        ).set(1)

    def render(self, names: Iterable[str] = ()) -> bytes:
        """Every family, or only those named (``/metrics?name[]=…``, as
        prometheus_client's own exposition filters): a caller that samples
        one gauge every few seconds neither renders nor parses the rest.
        The exporter's own families re-render only what changed since the
        last render (``_Cached``); the scrape-time ones (held figures, load
        gauges, an engine's own vLLM registry) render every time."""
        wanted = frozenset(names)
        collectors: list[Any] = list(self.registry.collectors)
        collectors.extend([self._native] if self._native is not None else self.vllm_registry.collectors)
        with self._render_lock:
            return b"".join([_exposition(collector, wanted) for collector in collectors])

    def render_uncached(self, names: Iterable[str] = ()) -> bytes:
        """``render`` by prometheus_client's generic exposition of every family:
        the same bytes, the cost the cache saves (tests and
        ``python manage.py bench_metrics_page`` compare the two)."""
        sources: list[Any] = [self.registry]
        sources.append(self._native if self._native is not None else self.vllm_registry)
        wanted = frozenset(names)
        return generate_latest(_FamilyFilter(_Concat(*sources), _named(wanted)) if wanted else _Concat(*sources))

    # ---- EngineObserver (engine thread) ---------------------------------------
    def on_step(self, step: StepMetrics) -> None:
        end = step.start_time + step.duration_seconds
        fragmentation = step.kv_fragmentation or 0.0
        with self._lock:
            self._advance(end)
            self._fragmentation = fragmentation
            self._memory_bytes = step.memory_bytes
            self._recent_peaks.append(_Peak(end, max(step.peak_memory_bytes, step.memory_bytes)))
            self._trim_peaks(end)
        self.steps.inc()
        self._observe_gaps(step, end)
        tokens = step.num_prefill_tokens + step.num_decode_tokens
        if step.num_prefill_tokens and tokens:
            self.prefill_seconds.inc(step.duration_seconds * step.num_prefill_tokens / tokens)
            if step.num_prefill_tokens >= self._activation[0]:
                self._activation = (step.num_prefill_tokens, max(0, step.peak_memory_bytes - step.memory_bytes))
        self.step_tokens.labels(*self._labels, "prefill").inc(step.num_prefill_tokens)
        self.step_tokens.labels(*self._labels, "decode").inc(step.num_decode_tokens)
        for wait in step.prefill_chunk_waits:
            self.chunk_wait.observe(wait)
        if self._native is None:
            self.v_iteration.observe(step.num_prefill_tokens + step.num_decode_tokens)
            self.v_preemptions.inc(step.num_preemptions)
            self.v_cache_queries.inc(step.prefix_cache_queries)
            self.v_cache_hits.inc(step.prefix_cache_hits)

    def _observe_gaps(self, step: StepMetrics, end: float) -> None:
        """Remember a step that ran a long prefill; the gaps it lengthened are
        told apart when their requests' responses end (``_observe_request_gaps``)."""
        if step.max_prefill_tokens is None:
            return
        self._steps_say_prefill = True
        if step.max_prefill_tokens > self.long_prefill_tokens:
            self.long_prefill_steps.inc()
            self._long_steps.add(step.start_time, end)

    def _observe_request_gaps(self, m: RequestMetrics) -> None:
        """Each gap between two consecutive tokens of the request (as
        delivered), as a long-prefill one if a long-prefill step overlapped
        it. Before the first token there is no gap; idle time falls in no
        request's gap."""
        if not self._steps_say_prefill:
            return
        t = m.token_times
        for i, long in enumerate(self._long_steps.flags(t), start=1):
            (self.gap_long if long else self.gap_other).observe(t[i] - t[i - 1])

    def memory_figures(self) -> dict[str, float]:
        """Weights, KV bytes per token and activation bytes per prefill token
        (the largest prefill step's transient peak over its tokens: the engine's
        accounting on CPU, the allocator's measured peak on GPU); those the
        engine does not report are left out."""
        out: dict[str, float] = {}
        facts = getattr(self._engine, "memory_facts", None)
        known = facts() if facts is not None else None
        if known is not None:
            out["weight_bytes"] = known.weight_bytes
            out["kv_bytes_per_token"] = known.kv_bytes_per_token
        tokens, transient = self._activation
        if tokens:
            out["activation_bytes_per_token"] = transient / tokens
        return out

    # ---- the client's view (the server's event loop) -----------------------------
    def observe_delivered(
        self,
        metrics: RequestMetrics,
        writes: Sequence[tuple[float, int]] | None,
        *,
        received_at: float | None = None,
    ) -> None:
        """A finished request's client-facing latencies. ``writes``: its SSE
        events that carried tokens, (``time.monotonic()`` when written, tokens
        in it), for a streamed request; None for a whole reply, whose tokens
        reach the client at once and whose figures come from the engine's
        token times. ``received_at``: when the server began reading the
        request; TTFT counts from there (the engine's arrival comes after the
        body was read and tokenized, which on a busy worker read 0.7x the
        client's TTFT P99)."""
        m = metrics if writes is None else figures.delivered(metrics, writes)
        if received_at is not None and received_at < m.arrival_time:
            m = dataclasses.replace(m, arrival_time=received_at)
        if writes is not None:
            for lag in figures.delivery_lags(metrics, writes):
                self.delivery_lag.observe(max(0.0, lag))
        bucket = figures.prompt_bucket(m.num_prompt_tokens)
        if (ttft := figures.ttft_seconds(m)) is not None:
            self.ttft.observe(ttft)
            self.by_prompt[BY_PROMPT_TTFT].labels(*self._labels, bucket).observe(ttft)
        for gap in figures.token_gaps(m):
            self.itl.observe(gap)
        if (tpot := figures.tpot_seconds(m)) is not None:
            self.tpot.observe(tpot)
        if (stall := figures.max_gap_seconds(m)) is not None:
            self.max_gap.observe(stall)
            self.by_prompt[BY_PROMPT_MAX_GAP].labels(*self._labels, bucket).observe(stall)
        self._observe_request_gaps(m)

    def on_request_finished(self, request_id: str, metrics: RequestMetrics, finish_reason: str) -> None:
        if (gap := figures.max_gap_seconds(metrics)) is not None:
            self.engine_max_gap.observe(gap)
        if metrics.first_scheduled_time is not None and metrics.first_token_time is not None:
            self.by_prompt[BY_PROMPT_PREFILL].labels(
                *self._labels, figures.prompt_bucket(metrics.num_prompt_tokens)
            ).observe(metrics.first_token_time - metrics.first_scheduled_time)
        if self._native is not None:
            return
        m = metrics
        self.v_success.labels(*self._labels, finish_reason).inc()
        self.v_prompt.inc(m.num_prompt_tokens)
        self.v_generation.inc(m.num_output_tokens)
        self.v_prompt_hist.observe(m.num_prompt_tokens)
        self.v_gen_hist.observe(m.num_output_tokens)
        for gap in figures.token_gaps(m):
            self.v_itl.observe(gap)
        if (ttft := figures.ttft_seconds(m)) is not None:
            self.v_ttft.observe(ttft)
        if (tpot := figures.tpot_seconds(m)) is not None:
            self.v_tpot.observe(tpot)
            self.v_decode.observe(m.token_times[-1] - m.token_times[0])
        if (e2e := figures.e2e_seconds(m)) is not None:
            self.v_e2e.observe(e2e)
        if m.first_scheduled_time is not None:
            self.v_queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.v_prefill.observe(m.first_token_time - m.first_scheduled_time)
            if m.finished_time is not None:
                self.v_inference.observe(m.finished_time - m.first_scheduled_time)

    # ---- sample-and-hold -------------------------------------------------------
    def _advance(self, now: float) -> None:
        if self._held_since is not None and now > self._held_since:
            elapsed = now - self._held_since
            self._fragmentation_seconds += self._fragmentation * elapsed
            self._memory_byte_seconds += self._memory_bytes * elapsed
            self._held_seconds += elapsed
        if self._held_since is None or now > self._held_since:
            self._held_since = now

    def _trim_peaks(self, now: float) -> None:
        while self._recent_peaks and self._recent_peaks[0].at < now - RECENT_PEAK_WINDOW_SECONDS:
            self._recent_peaks.popleft()

    def held_figures(self) -> dict[str, float]:
        with self._lock:
            now = self.clock()
            self._advance(now)
            self._trim_peaks(now)
            recent_peak = max([self._memory_bytes, *(p.memory_bytes for p in self._recent_peaks)])
            return {
                "fragmentation": self._fragmentation,
                "fragmentation_seconds": self._fragmentation_seconds,
                "memory_bytes": self._memory_bytes,
                "memory_byte_seconds": self._memory_byte_seconds,
                "memory_recent_peak_bytes": recent_peak,
                "held_seconds": self._held_seconds,
            }


class _HeldFigures(Collector):
    """The sample-and-hold ``chunkpilot:*`` gauges and their integrals."""

    def __init__(self, exporter: MetricsExporter):
        self.exporter = exporter

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        e = self.exporter
        f = e.held_figures()
        labels = list(e._labels)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        yield gauge(
            "chunkpilot:kv_fragmentation_ratio",
            "Latest step's 1 - tokens stored / (blocks held x block_size).",
            f["fragmentation"],
        )
        yield counter(
            "chunkpilot:kv_fragmentation_ratio_seconds",
            "The fragmentation ratio integrated over time (rate = time-weighted mean).",
            f["fragmentation_seconds"],
        )
        yield gauge("chunkpilot:memory_bytes", "Engine memory in use now.", f["memory_bytes"])
        yield gauge(
            "chunkpilot:memory_recent_peak_bytes",
            f"Highest engine memory in use over the last {RECENT_PEAK_WINDOW_SECONDS:.0f} s.",
            f["memory_recent_peak_bytes"],
        )
        yield counter(
            "chunkpilot:memory_byte_seconds",
            "Engine memory in use integrated over time (rate = time-weighted mean).",
            f["memory_byte_seconds"],
        )
        memory = e.memory_figures()
        for key, doc in (
            ("weight_bytes", "The model's weights in engine memory."),
            ("kv_bytes_per_token", "K and V of one token over every layer, in the cache's dtype."),
            ("activation_bytes_per_token", "Transient bytes per prefill token at the largest prefill step seen."),
        ):
            if key in memory:
                yield gauge(f"chunkpilot:{key}", doc, memory[key])
        yield gauge(
            "chunkpilot:long_prefill_tokens",
            "The long-prefill threshold in use: a prefill of more than this many tokens (left after its prefix "
            "hit) is long (max(64, max_model_len // 16)).",
            e.long_prefill_tokens,
        )
        yield gauge("chunkpilot:max_model_len", "The engine's context length, in tokens.", e.max_model_len)
        yield counter(
            "chunkpilot:stream_merged_deltas",
            "Engine deltas merged into an earlier SSE event because the worker's event loop fell behind "
            "(the whole process, every engine since it started).",
            stream.merged_deltas_total(),
        )
        yield counter(
            "chunkpilot:held_seconds",
            "The time the *_seconds integrals cover: divide their increase by this one's for the "
            "mean over the time this worker was up (a worker younger than the window is not diluted).",
            f["held_seconds"],
        )


class _LoadGauges(Collector):
    """vLLM's scheduler gauges, read from the engine at scrape time."""

    def __init__(self, exporter: MetricsExporter):
        self.exporter = exporter

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        e = self.exporter
        load = e._load() if e._load is not None else EngineLoad(0, 0, 0.0)
        labels = list(e._labels)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", load.num_requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load.num_requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", load.kv_cache_usage_perc),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            yield g
