"""What the experiment pages show: the list, a workload's histograms, and
one experiment live (progress, the results table with its spread, the
plot, the recommendation), built once for the page, the htmx refresh and
the websocket push alike."""

from __future__ import annotations

import json
from typing import Any

from django.db.models import QuerySet
from django.template.loader import render_to_string

from controlplane.experiments.measure import FIGURES, upgrade_figures
from controlplane.experiments.models import COMPARED_FIGURES, Arm, ArmStatus, Experiment, Phase, Workload
from dashboards import axes
from workers.replay import Histogram

LIST_LIMIT = 200
HISTOGRAM_BARS = 40
# The results table's columns, in order (measure.FIGURES keys).
TABLE_FIGURES = (
    "output_throughput",
    "goodput",
    "capacity",
    "client_ttft_p99",
    "client_stall_p99",
    "client_itl_p99",
    "memory_peak_bytes",
    "memory_mean_bytes",
    "prefill_wait_p99",
    "kv_fragmentation_mean",
    "preemptions",
    "prefix_hit_share",
)
_FIGURE = {key: (label, unit, display) for key, label, unit, display in FIGURES}


def base_queryset() -> QuerySet[Experiment]:
    return Experiment.objects.select_related("workload", "created_by", "verifies").prefetch_related("workers")


def list_context() -> dict[str, Any]:
    return {
        "experiments": list(base_queryset()[:LIST_LIMIT]),
        "workloads": list(Workload.objects.order_by("-created")[:50]),
    }


# ---- workloads ---------------------------------------------------------------------------


def bars(h: Histogram, num_bars: int = HISTOGRAM_BARS) -> list[dict[str, Any]]:
    """The fine buckets merged into about ``num_bars`` bars for display,
    each with its share of the requests (the tail stays: bars are by
    bucket index, and the buckets are log-spaced)."""
    if not h.total:
        return []
    per = max(1, -(-len(h.counts) // num_bars))
    top = 0.0
    out = []
    for i in range(0, len(h.counts), per):
        count = sum(h.counts[i : i + per])
        share = count / h.total
        top = max(top, share)
        out.append(
            {"low": h.edges[i], "high": h.edges[min(i + per, len(h.counts))] - 1, "count": count, "share": share}
        )
    for bar in out:
        bar["height"] = round(100 * bar["share"] / top, 1) if top else 0
    return out


def workload_context(workload: Workload) -> dict[str, Any]:
    spec = workload.workload_spec()
    return {
        "workload": workload,
        "spec": spec,
        "prompt_bars": bars(spec.prompt_tokens),
        "output_bars": bars(spec.output_tokens),
        "prompt_p50": spec.prompt_tokens.quantile(0.5),
        "prompt_p99": spec.prompt_tokens.quantile(0.99),
        "output_p50": spec.output_tokens.quantile(0.5),
        "output_p99": spec.output_tokens.quantile(0.99),
        "spec_json": json.dumps({"spec": workload.spec}),
    }


# ---- one experiment ------------------------------------------------------------------------


def _cell(arm: Arm, key: str) -> dict[str, Any]:
    s = (arm.summary or {}).get(key) or {}
    if key == "capacity" and not s and arm.capacity is not None:
        s = {"mean": arm.capacity, "half_range": 0.0}
    if not s and arm.results:  # an arm under way: its repeats so far
        figures = [upgrade_figures(r["figures"]) for r in arm.results]
        values = [f[key] for f in figures if f.get(key) is not None]
        s = {"mean": sum(values) / len(values), "half_range": (max(values) - min(values)) / 2} if values else {}
    label, unit, display = _FIGURE[key]
    return {"key": key, "mean": s.get("mean"), "half_range": s.get("half_range"), "display": display}


# The plot's series (experiments.js's names) and the figures they show.
PLOT_SERIES = {
    "output_throughput": "output_throughput",
    "goodput": "goodput",
    "ttft_p99": "client_ttft_p99",
    "stall_p99": "client_stall_p99",
}


# The plot's value axes (experiments.js's scale names): the series on each, and how its ticks read.
PLOT_SCALES = (
    ("tok", ("output_throughput",), "number", ""),  # the axis's own label names the unit
    ("req", ("goodput",), "number", ""),
    ("s", ("ttft_p99", "stall_p99"), "duration", "s"),
)


def num_requests(arm: Arm) -> int:
    """The requests the arm's measured repeats sent: what backs its point."""
    return sum(int((r.get("client") or {}).get("num_requests") or 0) for r in arm.results)


def plot_payload(arms: list[Arm], predicted_arms: list[Arm] | None = None) -> dict[str, Any]:
    """The plot: throughput and goodput against chunk size, TTFT P99 and
    stall P99 (the client's) on a second axis, the monolithic arm's
    throughput and goodput as flat lines; with the requests and repeats
    behind each point. ``predicted_arms`` (a verification's prediction):
    their throughput and goodput at the same chunk sizes beside the
    measured ones (``predicted``)."""

    def mean(arm: Arm | None, key: str) -> float | None:
        return (upgrade_figures(arm.summary or {}).get(key) or {}).get("mean") if arm else None

    measured = [a for a in arms if a.status == ArmStatus.SUCCEEDED]
    chunked = sorted((a for a in measured if a.chunk_size is not None), key=lambda a: a.chunk_size or 0)
    baseline = next((a for a in measured if a.chunk_size is None), None)
    xs = [a.chunk_size for a in chunked]
    series = {name: [mean(a, key) for a in chunked] for name, key in PLOT_SERIES.items()}
    base = {name: mean(baseline, key) for name, key in PLOT_SERIES.items()} if baseline else {}
    predicted: dict[str, Any] | None = None
    shown: dict[str, list[float | None]] = {}  # the predicted values each axis must hold
    if predicted_arms is not None:
        by_name = {a.name: a for a in predicted_arms if a.status == ArmStatus.SUCCEEDED}
        predicted_base = {
            name: mean(by_name.get(baseline.name), PLOT_SERIES[name]) if baseline else None
            for name in ("output_throughput", "goodput")
        }
        predicted = {"baseline": predicted_base}
        for name in ("output_throughput", "goodput"):
            predicted[name] = [mean(by_name.get(a.name), PLOT_SERIES[name]) for a in chunked]
            shown[name] = [*predicted[name], predicted_base[name]]
    scales = {}  # experiments.js's scales: each axis from zero, so a 1% gap looks like 1%
    for scale, names, display, unit in PLOT_SCALES:
        values = [v for n in names for v in (*series[n], base.get(n), *shown.get(n, []))]
        axis = axes.value_axis(iter(values), display, unit)
        scales[scale] = axis.to_json() if axis else None
    return {
        "x": xs,
        "x_range": axes.log_range([x for x in xs if x is not None]),
        "axes": scales,
        "arms": [a.name for a in chunked],
        **series,
        "predicted": predicted,
        "requests": [num_requests(a) for a in chunked],
        "repeats": [len(a.results) for a in chunked],
        "baseline": {
            **base,
            "name": baseline.name,
            "requests": num_requests(baseline),
            "repeats": len(baseline.results),
        }
        if baseline
        else None,
    }


def conditions_rows(experiment: Experiment, arms: list[Arm]) -> dict[str, Any]:
    """Each arm's conditions beside the workload's (``Arm.conditions``)."""
    spec = experiment.workload.workload_spec()
    rows = []
    for a in arms:
        c = a.conditions(experiment)
        rows.append({"arm": a, "c": c, "not_comparable": list(c.not_comparable)})
    return {
        "workload_rate": spec.rate_per_second * experiment.rate_scale,
        "workload_prefix_share": spec.prefix_hit_share,
        "workload_requests": round(spec.rate_per_second * experiment.rate_scale * experiment.duration_seconds),
        "rows": rows,
    }


def versus_baseline(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The recommendation's paired differences against the baseline, for
    the table (an old recommendation has none)."""
    out = []
    for name, d in (rec.get("versus_baseline") or {}).items():
        n = int(d.get("num_pairs") or 0)
        significant = n >= 2 and ((d.get("low") or 0) > 0 or (d.get("high") or 0) < 0)
        out.append({"arm": name, **d, "significant": significant})
    return out


def comparison(experiment: Experiment) -> dict[str, Any] | None:
    """A verification's table: per arm, each compared figure predicted
    beside measured, and measured over predicted."""
    prediction = experiment.verifies
    if prediction is None:
        return None
    columns = [{"key": k, "label": _FIGURE[k][0], "unit": _FIGURE[k][1]} for k in COMPARED_FIGURES]
    rows = []
    for row in experiment.predicted_against_measured():
        cells = []
        for key in COMPARED_FIGURES:
            f = row["figures"][key]
            display = _FIGURE[key][2]
            cells.append(
                {
                    "key": key,
                    "predicted": {"key": key, "mean": f["predicted"], "half_range": None, "display": display},
                    "measured": {"key": key, "mean": f["measured"], "half_range": None, "display": display},
                    "ratio": f["ratio"],
                }
            )
        rows.append({"arm": row["arm"], "cells": cells})
    return {"prediction": prediction, "label": prediction.predicted_label, "columns": columns, "rows": rows}


def detail_context(experiment: Experiment, user_context: dict[str, Any] | None = None) -> dict[str, Any]:
    arms = list(experiment.arms.select_related("revision__profile").order_by("index"))
    rec = experiment.recommendation or {}
    progress = experiment.progress or {}
    running = not experiment.is_finished
    columns = [k for k in TABLE_FIGURES if k != "capacity" or experiment.measures_capacity]
    rows = [
        {
            "arm": a,
            "cells": [_cell(a, k) for k in columns],
            "is_winner": a.name == rec.get("winner"),
            "is_baseline": a.name == (experiment.baseline or "baseline"),
            "broke": (rec.get("broke") or {}).get(a.name, []),
            "num_requests": num_requests(a),
        }
        for a in arms
    ]
    prediction = experiment.verifies
    plot = plot_payload(arms, list(prediction.arms.all()) if prediction is not None else None)
    return {
        **(user_context or {}),
        "experiment": experiment,
        "arms": arms,
        "rows": rows,
        "columns": [{"key": k, "label": _FIGURE[k][0], "unit": _FIGURE[k][1]} for k in columns],
        "progress": progress,
        "running": running,
        "recommendation": rec,
        "num_done": sum(1 for a in arms if ArmStatus(a.status).finished),
        "plot_json": json.dumps(plot),
        "plot_points": [
            {"arm": name, "requests": n, "repeats": r}
            for name, n, r in zip(plot["arms"], plot["requests"], plot["repeats"], strict=True)
        ]
        + (
            [
                {
                    "arm": plot["baseline"]["name"],
                    "requests": plot["baseline"]["requests"],
                    "repeats": plot["baseline"]["repeats"],
                }
            ]
            if plot["baseline"]
            else []
        ),
        "conditions": conditions_rows(experiment, arms),
        "versus_baseline": versus_baseline(rec),
        "can_abort": experiment.phase < Phase.RESTORING and not experiment.abort_requested,
        "can_adopt": experiment.phase == Phase.SUCCEEDED and bool(rec.get("winner")),
        "predicts": experiment.predicts,
        "predicted_label": experiment.predicted_label if experiment.predicts else "",
        "can_verify": experiment.predicts and experiment.phase == Phase.SUCCEEDED,
        "verify_arms": [a.name for a in experiment.arms_to_verify()] if experiment.predicts else [],
        "verifications": list(experiment.verifications.order_by("-created")) if experiment.predicts else [],
        "comparison": comparison(experiment),
        "workers": sorted(w.name for w in experiment.workers.all()),
    }


def render_detail_push(experiment_id: int, user_context: dict[str, Any]) -> str | None:
    experiment = base_queryset().filter(pk=experiment_id).first()
    if experiment is None:
        return None
    return render_to_string("experiments/partials/live.html", {**detail_context(experiment, user_context), "oob": True})


def render_list_push() -> str:
    return render_to_string("experiments/partials/rows.html", {**list_context(), "oob": True})
