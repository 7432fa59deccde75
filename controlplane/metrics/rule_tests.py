"""Unit tests of the shipped Prometheus rules for ``promtool test rules``,
generated beside them as ``deploy/prometheus/rules.test.yml``.

* Every recording rule of a figure runs over a small synthetic fleet (two
  models; stable, canary and baseline pools; six workers) and must record,
  per group, the value the control plane's own arithmetic gives for that
  figure from the same increases (``Figure.from_targets``). So a figure's
  PromQL and its definition in the registry cannot drift apart unnoticed.
* Every alerting rule has a scenario below: series that make it fire for one
  group and not for another, checked before its ``for:`` has run out
  (nothing fires) and after (exactly the expected alerts, with their labels
  and rendered annotations).

A rule without a test stops the generation (``MissingRuleTest``), so
``export_deploy`` cannot write a rule file whose rules are not all tested.

Series are sampled every minute and rise linearly, so ``rate()`` over five
minutes is exact under either range rule (Prometheus 2 includes a sample on
the range's start, 3 does not). Recorded values are compared after
``round()`` to seven significant digits: Go and NumPy compute a quantile of
rates and of increases in different orders, which can differ in the last
bit. Pure, no Django.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import yaml

from controlplane.metrics import catalogue, deploy, figures
from controlplane.metrics.figures import TargetWindows

INTERVAL_SECONDS = 60
NUM_MINUTES = 25  # samples at minutes 0..25: room for the longest for: (15m) and a margin
WINDOW_SECONDS = 300  # the rules' RULE_WINDOW
CHECK_AT_MINUTE = 10
SIGNIFICANT_DIGITS = 7
HEADER = (
    "# Unit tests of rules.yml for `promtool test rules rules.test.yml`: every recording rule's value\n"
    "# over a synthetic fleet as the control plane computes that figure, and a scenario per alert.\n"
    "# Generated from controlplane/metrics/rule_tests.py by `python manage.py export_deploy`; do not edit.\n"
)


class MissingRuleTest(LookupError):
    """A shipped rule that nothing here tests."""


# ---- the synthetic fleet -------------------------------------------------------------

BOUNDS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # then +Inf
# A value standing for each bucket's observations, for the histograms' _sum.
_TYPICAL = (0.025, 0.075, 0.175, 0.375, 0.75, 1.75, 3.75, 10.0)
# Observations per minute in each bucket (the last is above 5 s). P99 of
# FAST is 0.7 s, of MEDIUM 2.05 s, of SLOW 4.7 s.
FAST = (20, 30, 8, 1, 1, 0, 0, 0)
MEDIUM = (0, 5, 20, 25, 8, 2, 0, 0)
SLOW = (0, 0, 5, 10, 20, 20, 5, 0)

# The per-minute increase of each counter the figures read, by catalogue key.
_COUNTERS: dict[str, float] = {
    "vllm:request_success_total": 60.0,
    "vllm:generation_tokens_total": 3840.0,
    "vllm:prompt_tokens_total": 15360.0,
    "vllm:num_preemptions_total": 3.0,
    "vllm:prefix_cache_queries_total": 15360.0,
    "vllm:prefix_cache_hits_total": 3840.0,
    "chunkpilot:steps_total": 1200.0,
    "chunkpilot:step_tokens_total{kind=prefill}": 15360.0,
    "chunkpilot:step_tokens_total{kind=decode}": 3840.0,
    "chunkpilot:long_prefill_steps_total": 12.0,
    "chunkpilot:prefill_seconds_total": 6.0,
    "chunkpilot:stream_merged_deltas_total": 2.0,
}
# Where the recent-peak gauge shows a spike: once in any five-minute range.
_SPIKE_MINUTES = {3, 8, 13, 18, 23}


@dataclass(frozen=True)
class SyntheticWorker:
    """One worker's behaviour, constant over the test's 25 minutes."""

    name: str
    model: str
    pool: str
    cohort: str
    histograms: Mapping[str, Sequence[int]] = field(default_factory=dict)  # default FAST
    counters: Mapping[str, float] = field(default_factory=dict)  # per minute; default _COUNTERS
    memory_bytes: float = 2.0**30
    memory_peak_bytes: float = 1.5 * 2.0**30
    fragmentation: float = 0.25

    @property
    def labels(self) -> dict[str, str]:
        return {
            "job": deploy.WORKERS_JOB,
            "instance": f"{self.name}:8000",
            "worker": self.name,
            "pool": self.pool,
            "cohort": self.cohort,
            "model_name": self.model,
            "engine": "0",
        }

    def buckets(self, histogram: str) -> Sequence[int]:
        return self.histograms.get(histogram, FAST)

    def per_minute(self, key: str) -> float:
        """The per-minute increase of a catalogue key (counters, buckets, _sum, _count)."""
        if key in self.counters:
            return self.counters[key]
        if key in _COUNTERS:
            return _COUNTERS[key]
        if key == "chunkpilot:held_seconds_total":
            return INTERVAL_SECONDS
        if key == "chunkpilot:memory_byte_seconds_total":
            return self.memory_bytes * INTERVAL_SECONDS
        if key == "chunkpilot:kv_fragmentation_ratio_seconds_total":
            return self.fragmentation * INTERVAL_SECONDS
        for histogram in catalogue.HISTOGRAMS:
            counts = self.buckets(histogram)
            if key == f"{histogram}_count":
                return float(sum(counts))
            if key == f"{histogram}_sum":
                return float(sum(c * v for c, v in zip(counts, _TYPICAL, strict=True)))
            if key.startswith(f"{histogram}_bucket{{le="):
                bound = float(key.split("le=", 1)[1][:-1])
                return float(sum(c for c, b in zip(counts, (*BOUNDS, math.inf), strict=True) if b <= bound))
        raise KeyError(key)

    def peak_samples(self) -> list[float]:
        return [self.memory_peak_bytes if m in _SPIKE_MINUTES else self.memory_bytes for m in range(NUM_MINUTES + 1)]


def _selector(name: str, labels: Mapping[str, str]) -> str:
    inside = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inside}}}"


def _number(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def _rising(per_minute: float) -> str:
    return f"0+{_number(per_minute)}x{NUM_MINUTES}"


def input_series(workers: Iterable[SyntheticWorker], names: Iterable[str]) -> list[dict[str, str]]:
    """The series each worker serves under these sample names (as PromQL
    reads them: ``x_bucket``, ``x_sum``, counters, the peak gauge)."""
    out = []
    for name in sorted(set(names)):
        for w in workers:
            if name == catalogue.PEAK_MEMORY:
                out.append(
                    {"series": _selector(name, w.labels), "values": " ".join(_number(v) for v in w.peak_samples())}
                )
            elif name.endswith("_bucket") and name[: -len("_bucket")] in catalogue.HISTOGRAMS:
                for bound in (*BOUNDS, math.inf):
                    key = catalogue.bucket_key(name[: -len("_bucket")], bound)
                    le = "+Inf" if math.isinf(bound) else repr(bound)
                    out.append(
                        {"series": _selector(name, {**w.labels, "le": le}), "values": _rising(w.per_minute(key))}
                    )
            elif name == "chunkpilot:step_tokens_total":
                for kind in ("prefill", "decode"):
                    per_minute = w.per_minute(f"chunkpilot:step_tokens_total{{kind={kind}}}")
                    out.append({"series": _selector(name, {**w.labels, "kind": kind}), "values": _rising(per_minute)})
            elif name == "vllm:request_success_total":
                # vLLM labels finished requests by why they finished.
                out.append(
                    {
                        "series": _selector(name, {**w.labels, "finished_reason": "length"}),
                        "values": _rising(w.per_minute(name)),
                    }
                )
            else:
                out.append({"series": _selector(name, w.labels), "values": _rising(w.per_minute(name))})
    return out


# ---- the control plane's value for the same inputs -----------------------------------

_LAYOUT = catalogue.layout_for({h: BOUNDS for h in catalogue.HISTOGRAMS})


def _windows(w: SyntheticWorker, end_minute: int) -> TargetWindows:
    minutes = WINDOW_SECONDS // INTERVAL_SECONDS
    increases = np.zeros((1, len(_LAYOUT)))
    for i, key in enumerate(_LAYOUT.keys):
        if key not in catalogue.GAUGES:
            increases[0, i] = minutes * w.per_minute(key)
    # max_over_time over (end - window, end]: the samples after its start.
    peak = max(w.peak_samples()[end_minute - minutes + 1 : end_minute + 1])
    return TargetWindows(
        {"worker": w.name, "pool": w.pool, "cohort": w.cohort},
        _LAYOUT,
        increases,
        np.array([peak]),
        float(WINDOW_SECONDS),
    )


GroupKey = tuple[str, str, str]  # model_name, pool, cohort: the rules' grouping


def figure_values(
    figure: str, workers: Sequence[SyntheticWorker], end_minute: int = CHECK_AT_MINUTE
) -> dict[GroupKey, float]:
    """The figure per (model, pool, cohort) over the window ending at ``end_minute``."""
    groups: dict[GroupKey, list[SyntheticWorker]] = {}
    for w in workers:
        groups.setdefault((w.model, w.pool, w.cohort), []).append(w)
    return {
        key: float(figures.get(figure).from_targets([_windows(w, end_minute) for w in members], 1)[0])
        for key, members in sorted(groups.items())
    }


def _group_labels(key: GroupKey) -> dict[str, str]:
    return {"model_name": key[0], "pool": key[1], "cohort": key[2]}


def _scale(values: Iterable[float]) -> int:
    """The power of ten to keep SIGNIFICANT_DIGITS of the smallest value."""
    finite = [abs(v) for v in values if v != 0]
    return SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(min(finite))) if finite else 9


def _rounded(expr: str, scale: int) -> tuple[str, Callable[[float], float]]:
    """PromQL rounding ``expr`` to ``scale`` decimals, and the same in
    Python operation for operation (Go's funcRound with its default 1:
    ``floor(v + 0.5)``). Division by an exact power of ten keeps the
    expected values as short as the decimals they are."""
    if scale >= 0:
        factor = 10.0**scale
        return f"round({expr} * {factor:.0f}) / {factor:.0f}", lambda v: math.floor(v * factor + 0.5) / factor
    factor = 10.0**-scale
    return f"round({expr} / {factor:.0f}) * {factor:.0f}", lambda v: math.floor(v / factor + 0.5) * factor


def _rounded_check(record: str, expected: Mapping[tuple[tuple[str, str], ...], float], at: str) -> dict[str, Any]:
    """A promql_expr_test of the record rounded to 7 significant digits of
    its smallest value (so of every value)."""
    expr, rounding = _rounded(record, _scale(expected.values()))
    samples = []
    for labels, value in sorted(expected.items()):
        rounded = rounding(value)
        # A value this close to a rounding boundary could round either way
        # in Go: change the inputs rather than ship a test that may flake.
        if {rounding(value * (1 + d)) for d in (-1e-12, 1e-12)} != {rounded}:
            raise ValueError(f"{record} {dict(labels)}: {value!r} sits on a rounding boundary; change the inputs")
        samples.append({"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in labels) + "}", "value": rounded})
    return {"expr": expr, "eval_time": at, "exp_samples": samples}


# ---- rendering annotations as Prometheus does ----------------------------------------


def humanize_duration(seconds: float) -> str:
    """Prometheus's ``humanizeDuration`` template function."""
    if math.isnan(seconds) or math.isinf(seconds):
        return f"{seconds:.4g}"
    if seconds == 0:
        return "0s"
    if abs(seconds) >= 1:
        sign, v = ("-", -seconds) if seconds < 0 else ("", seconds)
        whole = int(v)
        s, m, h, d = whole % 60, (whole // 60) % 60, (whole // 3600) % 24, whole // 86400
        if d:
            return f"{sign}{d}d {h}h {m}m {s}s"
        if h:
            return f"{sign}{h}h {m}m {s}s"
        if m:
            return f"{sign}{m}m {s}s"
        return f"{sign}{v:.4g}s"
    prefix, v = "", seconds
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(v) >= 1:
            break
        prefix, v = p, v * 1000
    return f"{v:.4g}{prefix}s"


def _four_digits(value: float) -> float:
    """The value as a 4-digit rendering sees it, refusing one on a boundary."""
    if len({f"{value * (1 + d):.4g}" for d in (-1e-12, 0, 1e-12)}) != 1:
        raise ValueError(f"{value!r} renders differently within a rounding error; change the inputs")
    return value


# ---- recording rules ----------------------------------------------------------------

TTFT, ITL, TPOT, QUEUE = figures.TTFT, figures.ITL, figures.TPOT, figures.QUEUE
MAX_GAP, CHUNK_WAIT = figures.MAX_GAP, figures.CHUNK_WAIT
# Two models: m has a stable pool of two workers and a canary; n has a
# stable, a baseline and a canary pool.
FLEET: tuple[SyntheticWorker, ...] = (
    SyntheticWorker("a1", "m", "gpu-a", "stable"),
    SyntheticWorker(
        "a2",
        "m",
        "gpu-a",
        "stable",
        histograms={TTFT: MEDIUM, MAX_GAP: MEDIUM},
        counters={
            "vllm:num_preemptions_total": 9.0,
            "vllm:prefix_cache_hits_total": 7680.0,
            "chunkpilot:steps_total": 960.0,
        },
        memory_bytes=3.0 * 2.0**30,
        memory_peak_bytes=4.0 * 2.0**30,
        fragmentation=0.375,
    ),
    SyntheticWorker(
        "c1",
        "m",
        "gpu-c",
        "canary",
        histograms={h: SLOW for h in catalogue.HISTOGRAMS},
        counters={"vllm:request_success_total": 30.0, "chunkpilot:step_tokens_total{kind=prefill}": 7680.0},
        memory_peak_bytes=2.5 * 2.0**30,
        fragmentation=0.5,
    ),
    SyntheticWorker(
        "s1",
        "n",
        "gpu-n",
        "stable",
        histograms={TTFT: MEDIUM, ITL: MEDIUM, TPOT: MEDIUM},
        memory_bytes=2.0**31,
        memory_peak_bytes=2.0**32,
    ),
    SyntheticWorker("b1", "n", "gpu-nb", "baseline", histograms={QUEUE: SLOW, MAX_GAP: SLOW, CHUNK_WAIT: SLOW}),
    SyntheticWorker(
        "k1",
        "n",
        "gpu-nc",
        "canary",
        histograms={TTFT: MEDIUM},
        counters={"vllm:generation_tokens_total": 1920.0},
        fragmentation=0.125,
    ),
)


def _reference_values() -> dict[tuple[tuple[str, str], ...], float]:
    """``:reference``: per model, its baseline cohort's TTFT P99, else the
    highest stable pool's."""
    ttft = figure_values("ttft_p99", FLEET)
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for model in sorted({w.model for w in FLEET}):
        baseline = [v for (m, _, c), v in ttft.items() if m == model and c == "baseline"]
        stable = [v for (m, _, c), v in ttft.items() if m == model and c == "stable"]
        out[(("model_name", model),)] = max(baseline) if baseline else max(stable)
    return out


def _recorded_inputs(expr: str, recorded: Mapping[str, str]) -> set[str]:
    """The worker series an expression reads, through the recording rules it uses."""
    names = set()
    for name in deploy.metric_names(expr):
        names |= _recorded_inputs(recorded[name], recorded) if name in recorded else {name}
    return names


def _recording_test(record: str, expr: str, recorded: Mapping[str, str]) -> dict[str, Any]:
    at = f"{CHECK_AT_MINUTE}m"
    figure = record.removeprefix("chunkpilot:").removesuffix(f":{deploy.RULE_WINDOW}")
    if figure in deploy.RECORDED:
        expected = {tuple(sorted(_group_labels(k).items())): v for k, v in figure_values(figure, FLEET).items()}
        what = f"{record} records {figure} per model, pool and cohort as the control plane computes it"
    elif record == f"chunkpilot:ttft_p99:{deploy.RULE_WINDOW}:reference":
        expected = _reference_values()
        what = f"{record}: model n's baseline cohort, model m's (only) stable pool"
    else:
        raise MissingRuleTest(f"recording rule {record} has no test in controlplane/metrics/rule_tests.py")
    return {
        "name": what,
        "interval": f"{INTERVAL_SECONDS}s",
        "input_series": input_series(FLEET, _recorded_inputs(expr, recorded)),
        "promql_expr_test": [_rounded_check(record, expected, at)],
    }


# ---- alerting rules: one scenario each ----------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    what: str
    workers: tuple[SyntheticWorker, ...]
    raw_series: tuple[dict[str, str], ...]
    quiet_at: str  # before for: has run out: nothing fires
    firing_at: str
    expected: tuple[dict[str, Any], ...]  # exp_labels and exp_annotations of each alert firing then


def _alert(rule: Mapping[str, Any], labels: Mapping[str, str], **annotations: str) -> dict[str, Any]:
    return {"exp_labels": {**labels, **rule.get("labels", {})}, "exp_annotations": annotations}


def _worker_down(rule: Mapping[str, Any]) -> Scenario:
    a1, a2 = FLEET[0], FLEET[1]
    target = {k: a1.labels[k] for k in ("job", "instance", "worker", "pool", "cohort")}
    other = {k: a2.labels[k] for k in ("job", "instance", "worker", "pool", "cohort")}
    return Scenario(
        "a worker that stops answering /metrics at minute 2 pages after a minute; its neighbour does not",
        (),
        (
            {"series": _selector("up", target), "values": f"1 1 0x{NUM_MINUTES - 2}"},
            {"series": _selector("up", other), "values": f"1x{NUM_MINUTES}"},
        ),
        quiet_at="150s",
        firing_at="4m",
        expected=(
            _alert(
                rule,
                target,
                summary="Worker a1 does not answer /metrics.",
                description="Prometheus has not scraped a1:8000 for a minute.",
            ),
        ),
    )


def _slow_canary(histogram: str) -> tuple[SyntheticWorker, ...]:
    return (FLEET[0], replace(FLEET[2], histograms={histogram: SLOW}))


def _ttft_high(rule: Mapping[str, Any]) -> Scenario:
    workers = _slow_canary(TTFT)
    value = _four_digits(figure_values("ttft_p99", workers)[("m", "gpu-c", "canary")])
    return Scenario(
        "the canary's TTFT P99 (4.7 s) is over 2 s for 10 minutes; the stable pool's (0.7 s) is not",
        workers,
        (),
        quiet_at="10m",
        firing_at="13m",
        expected=(
            _alert(
                rule,
                _group_labels(("m", "gpu-c", "canary")),
                summary=f"TTFT P99 of canary in gpu-c is {humanize_duration(value)}.",
            ),
        ),
    )


def _stalls_high(rule: Mapping[str, Any]) -> Scenario:
    workers = _slow_canary(MAX_GAP)
    value = _four_digits(figure_values("stall_p99", workers)[("m", "gpu-c", "canary")])
    return Scenario(
        "requests on the canary stall 4.7 s at P99, over 1 s for 10 minutes; on the stable pool 0.7 s",
        workers,
        (),
        quiet_at="10m",
        firing_at="13m",
        expected=(
            _alert(
                rule,
                _group_labels(("m", "gpu-c", "canary")),
                summary=f"Requests in gpu-c stall {humanize_duration(value)} at P99: head-of-line "
                "blocking (a monolithic prefill?).",
            ),
        ),
    )


def _canary_regression(rule: Mapping[str, Any]) -> Scenario:
    workers = (
        SyntheticWorker("a1", "m", "gpu-a", "stable"),
        SyntheticWorker("c1", "m", "gpu-c", "canary", histograms={TTFT: SLOW}),
        SyntheticWorker("s1", "n", "gpu-n", "stable"),
        SyntheticWorker("b1", "n", "gpu-nb", "baseline", histograms={TTFT: SLOW}),
        SyntheticWorker("k1", "n", "gpu-nc", "canary", histograms={TTFT: MEDIUM}),
    )
    value = _four_digits(figure_values("ttft_p99", workers)[("m", "gpu-c", "canary")])
    return Scenario(
        "model m's canary (4.7 s) is over 1.2x its stable pool (0.7 s) and fires; model n's canary (2.05 s) is "
        "over 1.2x its stable pool but judged against its baseline (4.7 s), and does not",
        workers,
        (),
        quiet_at="10m",
        firing_at="13m",
        expected=(
            _alert(
                rule,
                _group_labels(("m", "gpu-c", "canary")),
                summary=f"The TTFT P99 of canary gpu-c is {humanize_duration(value)}, over 1.2× its "
                "baseline's: Chunkpilot aborts the rollout that owns it.",
            ),
        ),
    )


def _fragmentation_high(rule: Mapping[str, Any]) -> Scenario:
    workers = (FLEET[0], replace(FLEET[2], fragmentation=0.75))
    return Scenario(
        "the canary's KV fragmentation (0.75) is over 0.5 for 15 minutes; the stable pool's (0.25) is not",
        workers,
        (),
        quiet_at="15m",
        firing_at="18m",
        expected=(
            _alert(
                rule,
                _group_labels(("m", "gpu-c", "canary")),
                summary="Half the KV blocks held in gpu-c are empty slots: block_size too large?",
            ),
        ),
    )


def _preemptions(rule: Mapping[str, Any]) -> Scenario:
    workers = (FLEET[0], replace(FLEET[2], counters={"vllm:num_preemptions_total": 15.0}))
    value = figure_values("preemptions_per_second", workers)[("m", "gpu-c", "canary")]
    return Scenario(
        "the canary preempts 0.25 requests/s for 10 minutes; the stable pool 0.05/s",
        workers,
        (),
        quiet_at="10m",
        firing_at="13m",
        expected=(
            _alert(
                rule,
                _group_labels(("m", "gpu-c", "canary")),
                summary=f"gpu-c preempts {value!r} requests/s: KV cache too small for the load.",
            ),
        ),
    )


def _scrape_failing(rule: Mapping[str, Any]) -> Scenario:
    base = {"job": deploy.CONTROL_PLANE_JOB, "instance": "chunkpilot.example.com:443"}
    failing, fine = {**base, "worker": "a1", "pool": "gpu-a"}, {**base, "worker": "a2", "pool": "gpu-a"}
    return Scenario(
        "the control plane's scrapes of a1 fail from minute 1; of a2 they do not",
        (),
        (
            {"series": _selector("chunkpilot_worker_scrape_up", failing), "values": f"1 0x{NUM_MINUTES - 1}"},
            {"series": _selector("chunkpilot_worker_scrape_up", fine), "values": f"1x{NUM_MINUTES}"},
        ),
        quiet_at="150s",
        firing_at="4m",
        expected=(_alert(rule, failing, summary="The control plane cannot scrape a1; its dashboards lack it."),),
    )


def _canary_streams_silent(rule: Mapping[str, Any]) -> Scenario:
    base = {"job": deploy.CONTROL_PLANE_JOB, "instance": "chunkpilot.example.com:443", "model": "m"}
    canary = {**base, "cohort": "canary", "pool": "gpu-c", "worker": "c1"}
    stable = {**base, "cohort": "stable", "pool": "gpu-a", "worker": "a1"}
    return Scenario(
        "a canary stream goes silent from minute 1 and stays so; a silent stable stream does not count",
        (),
        (
            {"series": _selector("chunkpilot_gateway_streams_silent", canary), "values": f"0 1x{NUM_MINUTES - 1}"},
            {"series": _selector("chunkpilot_gateway_streams_silent", stable), "values": f"2x{NUM_MINUTES}"},
        ),
        quiet_at="90s",
        firing_at="4m",
        expected=(
            _alert(
                rule,
                {"model": "m", "pool": "gpu-c"},
                summary="1 streams of canary gpu-c have had no token for GATEWAY_STREAM_SILENCE_SECONDS: "
                "Chunkpilot aborts the rollout that owns it.",
            ),
        ),
    )


SCENARIOS: dict[str, Callable[[Mapping[str, Any]], Scenario]] = {
    "ChunkpilotCanaryStreamsSilent": _canary_streams_silent,
    "ChunkpilotWorkerDown": _worker_down,
    "ChunkpilotTTFTP99High": _ttft_high,
    "ChunkpilotStallsHigh": _stalls_high,
    "ChunkpilotCanaryTTFTRegression": _canary_regression,
    "ChunkpilotKVFragmentationHigh": _fragmentation_high,
    "ChunkpilotPreemptions": _preemptions,
    "ChunkpilotControlPlaneScrapeFailing": _scrape_failing,
}


def _alert_test(rule: Mapping[str, Any], recorded: Mapping[str, str]) -> dict[str, Any]:
    name = rule["alert"]
    if name not in SCENARIOS:
        raise MissingRuleTest(f"alert {name} has no scenario in controlplane/metrics/rule_tests.py")
    s = SCENARIOS[name](rule)
    return {
        "name": f"{name}: {s.what}",
        "interval": f"{INTERVAL_SECONDS}s",
        "input_series": [*s.raw_series, *input_series(s.workers, _recorded_inputs(rule["expr"], recorded))],
        "alert_rule_test": [
            {"eval_time": s.quiet_at, "alertname": name, "exp_alerts": []},
            {"eval_time": s.firing_at, "alertname": name, "exp_alerts": list(s.expected)},
        ],
    }


# ---- the file ------------------------------------------------------------------------


def rule_tests() -> dict[str, Any]:
    groups = deploy.prometheus_rules()["groups"]
    recorded = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    # The recording group's own interval, so promtool evaluates it at every step.
    evaluation_interval = next(g["interval"] for g in groups if "interval" in g)
    tests = [_recording_test(name, expr, recorded) for name, expr in recorded.items()]
    tests += [_alert_test(r, recorded) for g in groups for r in g["rules"] if "alert" in r]
    return {"rule_files": ["rules.yml"], "evaluation_interval": evaluation_interval, "tests": tests}


def rule_tests_yaml() -> str:
    return HEADER + yaml.safe_dump(rule_tests(), sort_keys=False, width=120, allow_unicode=True)
