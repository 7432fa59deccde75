"""Which scraped series the control plane keeps, and the row layout they pack into.

A worker's ``/metrics`` page is large (every vLLM family, with their
``_created`` twins); the figures need a few dozen series of it. A scrape is
reduced to one float vector in a fixed order, the **layout**: the counters
below, then each histogram's buckets by upper bound with its ``_sum`` and
``_count``, then the gauges. Series are summed over every label but ``le``
and ``kind`` (a worker has one engine, but vLLM labels by engine index and
finished reason). The layout depends only on the histograms' bucket bounds,
so it changes only when a worker changes engine; snapshots store the vector
and point at the layout.

Pure: no Django. ``parse`` takes Prometheus text; ``Layout`` finds series in a
vector by key.
"""

from __future__ import annotations

import hashlib
import math
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from controlplane.metrics.promql import Floats
from workers.figures import PROMPT_BUCKETS, prompt_bucket

# Counters, by their sample name; a ``{kind=...}`` suffix keeps that label.
COUNTERS: tuple[str, ...] = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "chunkpilot:steps_total",
    "chunkpilot:step_tokens_total{kind=prefill}",
    "chunkpilot:step_tokens_total{kind=decode}",
    "chunkpilot:kv_fragmentation_ratio_seconds_total",
    "chunkpilot:memory_byte_seconds_total",
    "chunkpilot:held_seconds_total",
    "chunkpilot:long_prefill_steps_total",
    "chunkpilot:prefill_seconds_total",
    "chunkpilot:stream_merged_deltas_total",
)
# The stored vector keeps this order (``layout_for``): counters, then these.
# The histograms the charts read (the panel's TTFT and prefill wait, the
# overview's TTFT) come first, so they and the counters are a short head of
# the vector (``Layout.head``, ~130 of ~2,000 values) that minute rollups
# also keep on their own for the charts to read (models.Rollup).
HISTOGRAMS: tuple[str, ...] = (
    # As the client sees them (written SSE events), in fine buckets: what the figures read.
    "chunkpilot:time_to_first_token_seconds",
    "chunkpilot:prefill_chunk_wait_seconds",
    "chunkpilot:inter_token_latency_seconds",
    "chunkpilot:request_time_per_output_token_seconds",
    "chunkpilot:engine_request_max_gap_seconds",
    "chunkpilot:delivery_lag_seconds",
    # vLLM's names and buckets, the engine's production times (experiments compare them).
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "chunkpilot:request_max_gap_seconds",
    "chunkpilot:decode_gap_long_prefill_seconds",
    "chunkpilot:decode_gap_other_seconds",
)
CHARTED_HISTOGRAMS = HISTOGRAMS[:2]
# Histograms the worker labels by prompt-length bucket (``prompt_bucket``):
# each is kept as one histogram per bucket, ``name{prompt_bucket=<=512}``,
# every bucket always in the layout (``by_prompt``).
BY_PROMPT_HISTOGRAMS: tuple[str, ...] = (
    "chunkpilot:time_to_first_token_by_prompt_seconds",
    "chunkpilot:request_max_gap_by_prompt_seconds",
    "chunkpilot:request_prefill_time_by_prompt_seconds",
)
GAUGES: tuple[str, ...] = (
    "chunkpilot:memory_recent_peak_bytes",
    "chunkpilot:memory_bytes",
    "chunkpilot:kv_fragmentation_ratio",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "chunkpilot:weight_bytes",
    "chunkpilot:kv_bytes_per_token",
    "chunkpilot:activation_bytes_per_token",
    "chunkpilot:long_prefill_tokens",
    "chunkpilot:max_model_len",
)
# The one gauge read as a maximum over a window (docs/architecture.md, "Metrics": a window's memory
# peak is the max of its scrapes). Stored beside the vector as a column so a
# long window's max is one SQL aggregate.
PEAK_MEMORY = "chunkpilot:memory_recent_peak_bytes"
# Labels of chunkpilot:profile_info that say what a worker ran at a scrape.
PROFILE_INFO = "chunkpilot:profile_info"

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def format_le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def bucket_key(histogram: str, bound: float) -> str:
    return f"{histogram}_bucket{{le={format_le(bound)}}}"


@dataclass(frozen=True)
class Layout:
    """The order of series in a stored vector."""

    keys: tuple[str, ...]
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {key: i for i, key in enumerate(self.keys)})

    @cached_property
    def digest(self) -> str:
        return hashlib.sha1("\n".join(self.keys).encode()).hexdigest()

    @cached_property
    def is_counter(self) -> np.ndarray:
        """True for every series that only goes up (counters, buckets, _sum, _count)."""
        gauges = set(GAUGES)
        return np.array([key not in gauges for key in self.keys], dtype=bool)

    def buckets(self, histogram: str) -> list[tuple[float, int]]:
        """(upper bound, position) of the histogram's buckets, lowest first."""
        return self._buckets.get(histogram, [])

    @cached_property
    def _buckets(self) -> dict[str, list[tuple[float, int]]]:
        out: dict[str, list[tuple[float, int]]] = {}
        for i, key in enumerate(self.keys):
            if "_bucket{le=" in key:
                histogram, bound = key.split("_bucket{le=", 1)
                out.setdefault(histogram, []).append((float(bound[:-1]), i))
        return {h: sorted(b) for h, b in out.items()}

    @cached_property
    def head(self) -> int:
        """How many leading series are the counters and ``CHARTED_HISTOGRAMS``:
        what a minute rollup keeps apart for the charts."""
        charted = tuple(f"{h}{suffix}" for h in CHARTED_HISTOGRAMS for suffix in ("_bucket{", "_sum", "_count"))
        ends = [i + 1 for i, key in enumerate(self.keys) if key.startswith(charted) or key in _COUNTER_KEYS]
        return max(ends, default=0)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class Scrape:
    """One worker's page reduced to the kept series."""

    layout: Layout
    values: Floats
    profile: dict[str, str]  # chunkpilot:profile_info's labels, empty when absent


def _sample_key(name: str, labels: dict[str, str]) -> str | None:
    if name.startswith("chunkpilot:step_tokens_total"):
        kind = labels.get("kind")
        return f"chunkpilot:step_tokens_total{{kind={kind}}}" if kind in ("prefill", "decode") else None
    if name in _COUNTER_SET or name in _GAUGE_SET:
        return name
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in _BY_PROMPT_SET:
            bucket = labels.get("prompt_bucket")
            if bucket not in _LENGTH_LABEL_SET:
                return None
            kept = by_prompt(name[: -len(suffix)], bucket)
            return bucket_key(kept, float(labels["le"])) if suffix == "_bucket" else f"{kept}{suffix}"
        if name.endswith(suffix) and name[: -len(suffix)] in _HISTOGRAM_SET:
            if suffix == "_bucket":
                return bucket_key(name[: -len(suffix)], float(labels["le"]))
            return name
    return None


_COUNTER_SET = {c for c in COUNTERS if "{" not in c}
_COUNTER_KEYS = set(COUNTERS)
_GAUGE_SET = set(GAUGES)
_HISTOGRAM_SET = set(HISTOGRAMS)
_BY_PROMPT_SET = set(BY_PROMPT_HISTOGRAMS)


def by_prompt(histogram: str, bucket: str) -> str:
    """The kept name of one prompt-length bucket's histogram."""
    return f"{histogram}{{prompt_bucket={bucket}}}"


def layout_for(bucket_bounds: Mapping[str, Iterable[float]]) -> Layout:
    """The layout for histograms with these bucket bounds (``+Inf`` added)."""
    keys: list[str] = list(COUNTERS)
    for histogram in HISTOGRAMS:
        bounds = sorted(set(bucket_bounds.get(histogram, ())) | {math.inf})
        keys.extend(bucket_key(histogram, b) for b in bounds)
        keys.extend((f"{histogram}_sum", f"{histogram}_count"))
    for histogram in BY_PROMPT_HISTOGRAMS:
        if histogram not in bucket_bounds:
            continue  # a worker that does not label them (an older one): none of them
        bounds = sorted(set(bucket_bounds[histogram]) | {math.inf})
        for label in LENGTH_BUCKET_LABELS:
            name = by_prompt(histogram, label)
            keys.extend(bucket_key(name, b) for b in bounds)
            keys.extend((f"{name}_sum", f"{name}_count"))
    keys.extend(GAUGES)
    return Layout(tuple(keys))


_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value) if "\\" in value else value


def _kept_names() -> frozenset[str]:
    names = {c.split("{", 1)[0] for c in COUNTERS} | set(GAUGES) | {PROFILE_INFO}
    for histogram in (*HISTOGRAMS, *BY_PROMPT_HISTOGRAMS):
        names.update(histogram + suffix for suffix in _HISTOGRAM_SUFFIXES)
    return frozenset(names)


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text page that the kept series are made
    of, as (name, labels, value). Reads only those lines' labels: a worker's
    page is thousands of lines (fine buckets, per prompt-length bucket), and
    a general parser spends most of a scrape round on lines nothing keeps."""
    kept = _KEPT_NAMES
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for stop in ("{", " "):
            i = line.find(stop)
            if 0 <= i < end:
                end = i
        if line[:end] not in kept:
            continue
        match = _SAMPLE_LINE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line[:200]!r}")
        name, inside, value = match.groups()
        labels = {k: _unescape(v) for k, v in _LABEL.findall(inside)} if inside else {}
        yield name, labels, float(value)


# What a series (a sample line before its value) reduces to: its kept key
# (None: not kept), and for a bucket its histogram and upper bound. A
# worker's page repeats the same series every scrape, so each is worked out
# once per process.
_Entry = tuple[str | None, str, float]
_SERIES_CACHE: dict[str, _Entry] = {}
_SERIES_CACHE_SIZE = 200_000
_NOT_KEPT: _Entry = (None, "", 0.0)


def _entry(name: str, labels: dict[str, str]) -> _Entry:
    key = _sample_key(name, labels)
    if key is None:
        return _NOT_KEPT
    if key.endswith("}") and "_bucket{le=" in key:
        histogram = key.split("_bucket{le=", 1)[0].split("{prompt_bucket=", 1)[0]
        return key, histogram, float(labels["le"])
    return key, "", 0.0


def _same_number(text: str, value: float) -> bool:
    try:
        return float(text) == value
    except ValueError:
        return False


def parse_lines(text: str) -> Scrape:
    """``parse``, line by line: every page's own reduction, and the one that
    plans a page shape's first page (and any page ``parse`` cannot plan)."""
    sums: dict[str, float] = {}
    bounds: dict[str, set[float]] = {}
    profile: dict[str, str] = {}
    cache = _SERIES_CACHE
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series, _, value_text = line.rpartition(" ")
        entry = cache.get(series)
        if entry is not None:
            value = float(value_text)
        else:
            parsed = next(samples(line), None)
            if parsed is None:  # a family nothing keeps
                entry = _NOT_KEPT
                value = math.nan
            else:
                name, labels, value = parsed
                if name == PROFILE_INFO:
                    if value == 1:
                        profile = {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
                    continue
                entry = _entry(name, labels)
            if entry is _NOT_KEPT or _same_number(value_text, value):
                # (a line with a timestamp has its value in ``series``: not cached)
                if len(cache) >= _SERIES_CACHE_SIZE:
                    cache.clear()
                cache[series] = entry
        key, histogram, le = entry
        if key is None:
            continue
        if histogram:
            bounds.setdefault(histogram, set()).add(le)
        sums[key] = sums.get(key, 0.0) + value
    layout = layout_for(bounds)
    values = np.array([sums.get(key, math.nan if key in _GAUGE_SET else 0.0) for key in layout.keys], dtype=np.float64)
    return Scrape(layout, values, profile)


def parse(text: str) -> Scrape:
    """Reduce Prometheus text to the kept series. Counters and histograms
    that the page lacks are 0 (nothing counted yet); missing gauges are NaN.

    A worker serves the same lines scrape after scrape, only their values
    moving (its layout changes only with its engine, its profile line with a
    profile switch), and parsing each line again cost ~2.5 ms a page. So a
    page whose lines before their values are those of a page seen before
    reuses that page's **plan**: which lines are kept, where each one adds
    into the layout, the layout itself. Its values are the only text read.
    A page of a new shape is reduced by ``parse_lines`` and planned; a plan
    is kept only when it reduces that page exactly as ``parse_lines`` did."""
    lines = text.split("\n")  # not splitlines(): faster, and a plan is checked against parse_lines
    series, _, values = zip(*[line.rpartition(" ") for line in lines], strict=True)
    for plan in _PLANS.get(len(series), ()):
        if plan.series == series:
            try:
                return plan.apply(values)
            except ValueError:  # a value that is not a number: as the lines say it
                break
    return _remember(_Plan.build(lines, series, values), parse_lines(text), values)


class _Numbers(dict[str, float]):
    """Numbers by their text: most of a page's values are the same few
    bucket counts, scrape after scrape, and a lookup is cheaper than float()."""

    def __missing__(self, text: str) -> float:
        if len(self) >= _MAX_NUM_NUMBERS:
            self.clear()
        value = self[text] = float(text)
        return value


_MAX_NUM_NUMBERS = 50_000
_NUMBERS = _Numbers()


@dataclass(frozen=True, eq=False)
class _Plan:
    """How the pages of one shape reduce: ``series`` is every line up to its
    last space (comments included), ``rows`` the lines kept, ``slots`` where
    each adds into the vector, ``template`` the vector before any adds (NaN
    for a gauge the page lacks)."""

    series: tuple[str, ...]
    layout: Layout
    template: np.ndarray
    rows: tuple[int, ...]
    slots: np.ndarray
    summed: bool  # some slot takes several rows (vLLM's finished reasons)
    profiles: tuple[tuple[int, dict[str, str]], ...]  # chunkpilot:profile_info's rows and labels

    @classmethod
    def build(cls, lines: list[str], series: tuple[str, ...], values: tuple[str, ...]) -> _Plan | None:
        """The plan of a page, or None when a kept line's last word is not its
        value (a timestamp after it): such a page is read line by line."""
        rows: list[int] = []
        keys: list[str] = []
        bounds: dict[str, set[float]] = {}
        profiles: list[tuple[int, dict[str, str]]] = []
        for row, line in enumerate(lines):
            if not line or line[0] == "#":
                continue
            parsed = next(samples(line), None)
            if parsed is None:
                continue
            name, labels, value = parsed
            if not _same_value(values[row], value):
                return None
            if name == PROFILE_INFO:
                profiles.append((row, {k: v for k, v in labels.items() if k not in ("model_name", "engine")}))
                continue
            key, histogram, le = _entry(name, labels)
            if key is None:
                continue
            if histogram:
                bounds.setdefault(histogram, set()).add(le)
            rows.append(row)
            keys.append(key)
        layout = layout_for(bounds)
        present = set(keys)
        template = np.array(
            [math.nan if key in _GAUGE_SET and key not in present else 0.0 for key in layout.keys], dtype=np.float64
        )
        slots = np.array([layout.index[key] for key in keys], dtype=np.intp)
        return cls(series, layout, template, tuple(rows), slots, len(present) < len(keys), tuple(profiles))

    def apply(self, values: tuple[str, ...]) -> Scrape:
        """The scrape of a page of this shape, from its lines' last words."""
        kept = [values[row] for row in self.rows] if len(self.rows) < 2 else operator.itemgetter(*self.rows)(values)
        added = np.fromiter(map(_NUMBERS.__getitem__, kept), dtype=np.float64, count=len(self.rows))
        out = self.template.copy()
        if self.summed:
            np.add.at(out, self.slots, added)  # in page order, as parse_lines sums
        else:
            out[self.slots] += added
        profile: dict[str, str] = {}
        for row, labels in self.profiles:
            if _NUMBERS[values[row]] == 1:
                profile = dict(labels)
        return Scrape(self.layout, out, profile)


# Plans by their page's number of lines; a control plane sees a few shapes
# (one per model and profile revision), so a full cache means churn: start over.
_PLANS: dict[int, list[_Plan]] = {}
_MAX_NUM_PLANS = 32


def _remember(plan: _Plan | None, scrape: Scrape, values: tuple[str, ...]) -> Scrape:
    """Keep the plan if it reduces its page as ``parse_lines`` did; the page's
    scrape either way (the plan's, so every page of a shape shares a layout)."""
    planned = plan.apply(values) if plan is not None else None
    if plan is None or planned is None or not _same_scrape(planned, scrape):
        return scrape
    if sum(len(plans) for plans in _PLANS.values()) >= _MAX_NUM_PLANS:
        _PLANS.clear()
    _PLANS.setdefault(len(plan.series), []).append(plan)
    return planned


def _same_value(text: str, value: float) -> bool:
    try:
        parsed = float(text)
    except ValueError:
        return False
    return parsed == value or (math.isnan(parsed) and math.isnan(value))


def _same_scrape(a: Scrape, b: Scrape) -> bool:
    return (
        a.layout == b.layout
        and a.profile == b.profile
        and np.array_equal(a.values, b.values, equal_nan=True)
        and bool((np.signbit(a.values) == np.signbit(b.values)).all())
    )


_KEPT_NAMES = _kept_names()

# The prompt-length buckets (docs/architecture.md, "Metrics"), named as the engine's figures name them.
LENGTH_BUCKET_LABELS: tuple[str, ...] = tuple(name for name, _ in PROMPT_BUCKETS)
_LENGTH_LABEL_SET = set(LENGTH_BUCKET_LABELS)


def length_bucket(prompt_tokens: int) -> str:
    return prompt_bucket(prompt_tokens)


@dataclass(frozen=True)
class Folded:
    totals: Floats  # counters reset-corrected, gauges as scraped
    offsets: Floats  # what each counter has lost to resets so far
    reset: bool


def fold(previous_raw: Floats | None, offsets: Floats | None, raw: Floats, is_counter: np.ndarray) -> Folded:
    """Add one scrape to a series set's running reduction.

    Stored counters are *totals*: the raw value plus everything lost to
    earlier resets, so they never go down and a window's reset-corrected
    increase is last minus first — exactly the increase Prometheus computes
    by adding the value before each reset. ``offsets`` is kept to recover a
    sample's raw value (Prometheus's zero-point check reads it)."""
    offsets = np.zeros_like(raw) if offsets is None else offsets.copy()
    reset = False
    if previous_raw is not None:
        dropped = is_counter & (raw < previous_raw)
        if dropped.any():
            offsets[dropped] += previous_raw[dropped]
            reset = True
    totals = np.where(is_counter, raw + offsets, raw)
    return Folded(totals, offsets, reset)
