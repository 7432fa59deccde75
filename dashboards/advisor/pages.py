"""What the Advisor pages show: the kept reports as plain sentences, each
answer expandable to its chart (bars drawn in HTML, so they need no
JavaScript), its figures and the thresholds it used.

The report itself is ``controlplane.advisor``'s JSON; this module only
formats it. The experiment button links to the experiments app's New
experiment page with the suggested arms in the query string.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from django.urls import reverse
from django.utils import timezone

from controlplane.advisor.models import FLEET, AdvisorReport, compute
from controlplane.advisor.verdicts import ANSWER_TEXT, FIGURE_UNITS, THRESHOLD_UNITS
from controlplane.fleet.models import Pool
from controlplane.metrics import query

WINDOWS: dict[str, float] = {"15m": 900, "1h": 3600, "6h": 21600, "24h": 86400}
ANSWER_LABELS = {a.value: text.lower() for a, text in ANSWER_TEXT.items()}
OVERALL_LABELS = {
    "worth_it": "worth it",
    "not_worth_it": "not worth it",
    "other_cause": "other cause",
    "not_enough_data": "not enough data",
}
OVERALL_SENTENCES = {
    "worth_it": "Chunked prefill is likely worth it.",
    "not_worth_it": "Chunked prefill is likely not worth it: its complexity may not pay.",
    "other_cause": "Decodes miss the TBT objective, but chunked prefill alone will not fix it.",
    "not_enough_data": "Not enough data to say whether chunked prefill is worth it yet.",
}
# The experiments app's New experiment page (issue 15), when it is installed.
EXPERIMENT_NEW_ROUTE = "experiment-new"
# A chart's unit in the figure vocabulary (``verdicts.FIGURE_UNITS``).
CHART_UNITS = {"s": "s", "ratio": "share"}


def format_value(value: Any, unit: str) -> str:
    """One figure or threshold, written once in its unit (``verdicts``'
    ``FIGURE_UNITS`` and ``THRESHOLD_UNITS``)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if not isinstance(value, (int, float)):
        return str(value)
    if unit in ("s", "s/token"):
        suffix = "" if unit == "s" else " per token"
        if value == 0:
            return f"0 s{suffix}"
        if abs(value) < 1e-3:
            return f"{value * 1e6:.3g} µs{suffix}"
        return (f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s") + suffix
    if unit in ("bytes", "B/token"):
        suffix = "" if unit == "bytes" else " per token"
        return (f"{value / 2**30:.3g} GiB" if value >= 2**30 else f"{value:,.0f} B") + suffix
    if unit == "share":
        return f"{value:.1%}"
    if unit == "times":
        return f"{value:.2f}×"
    if unit == "GB/s":
        return f"{value:g} GB/s"
    if unit == "tokens/s":
        return f"{value:,.4g} tokens/s"
    if unit in ("tokens", "requests", "samples", "gaps", "chunks"):
        return f"{value:,.0f} {unit}"
    return f"{value:,.4g}" if isinstance(value, float) else f"{value:,}"


# Suffixes a key carries for its unit, which the formatted value already says.
UNIT_SUFFIXES = ("_seconds_per_token", "_bytes_per_token", "_seconds", "_bytes")


def _label(key: str) -> str:
    for suffix in UNIT_SUFFIXES:
        if key.endswith(suffix) and key != suffix[1:]:
            key = key.removesuffix(suffix)
            break
    return key.replace("_", " ")


def bars(chart: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A bar chart's rows with their width as a share of the largest value."""
    labels, values = chart.get("labels") or [], chart.get("values") or []
    known = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    top = max(known, default=0) or 1
    unit = CHART_UNITS.get(chart.get("unit", ""), "count")
    return [
        {
            "label": label,
            "value": format_value(value, unit),
            "percent": 0 if value is None else max(0.0, min(100.0, 100 * value / top)),
        }
        for label, value in zip(labels, values, strict=False)
    ]


def finding(f: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **f,
        "answer_label": ANSWER_LABELS.get(f["answer"], f["answer"]),
        "knob_label": f"{f['direction']} {f['knob']}" if f.get("knob") else "",
        "bars": bars(f.get("chart") or {}),
        "figure_rows": [
            (_label(k), format_value(v, FIGURE_UNITS.get(k, ""))) for k, v in (f.get("figures") or {}).items()
        ],
        "threshold_rows": [
            (_label(k), format_value(v, THRESHOLD_UNITS.get(k, ""))) for k, v in (f.get("thresholds") or {}).items()
        ],
    }


def decision_rows(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The decision table the verdict came from, its matching row marked."""
    decision = body.get("decision") or {}
    return [
        {
            **row,
            "overall_label": OVERALL_LABELS.get(row["overall"], row["overall"]),
            "matched": i == decision.get("rule"),
        }
        for i, row in enumerate(decision.get("table") or [])
    ]


def knob_rows(knobs: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(_label(k), format_value(v, FIGURE_UNITS.get(k, ""))) for k, v in (knobs.get("figures") or {}).items()]


def experiment_link(body: Mapping[str, Any], scope: str) -> str:
    """The New experiment page with the suggested arm (chunk size, budget and
    threshold) in its query string, which that form takes as its initial values."""
    path = reverse(EXPERIMENT_NEW_ROUTE)
    knobs = body.get("knobs") or {}
    params = {"name": f"advisor-{scope}"}
    for key, value in (
        ("chunk_sizes", knobs.get("chunk_tokens")),
        ("budgets", knobs.get("max_num_batched_tokens")),
        ("short_prompt_thresholds", knobs.get("short_prompt_threshold")),
    ):
        if value is not None:
            params[key] = str(value)
    return f"{path}?{urlencode(params)}"


def window_of(params: Mapping[str, str]) -> str | None:
    text = params.get("window", "")
    return text if text in WINDOWS else None


def report_context(pool: Pool | None, window: str | None) -> dict[str, Any]:
    scope = pool.name if pool is not None else FLEET
    kept: AdvisorReport | None = None
    if window is None:
        kept = AdvisorReport.objects.filter(scope=scope).first() or AdvisorReport.refresh(pool)
        body = kept.body
    else:
        body = compute(pool, query.check_window(WINDOWS[window]), timezone.now())
    return {
        "scope": scope,
        "pool": pool,
        "kept": kept,
        "body": body,
        "overall_sentence": OVERALL_SENTENCES[body["overall"]],
        "overall_label": OVERALL_LABELS[body["overall"]],
        "decision_rows": decision_rows(body),
        "knob_rows": knob_rows(body["knobs"]),
        "questions": [finding(q) for q in body["questions"]],
        "head_of_line": finding(body["head_of_line"]),
        "tuning": [finding(t) for t in body["tuning"]],
        "pd": finding(body["pd"]),
        "pd_database": finding(body["pd_database"]) if body.get("pd_database") else None,
        "knobs": body["knobs"],
        "prefix_hits": {**body["prefix_hits"], "bars": bars(body["prefix_hits"])},
        "experiment_url": experiment_link(body, scope),
        "window_links": [{"label": "kept", "query": "", "active": window is None}]
        + [{"label": label, "query": urlencode({"window": label}), "active": label == window} for label in WINDOWS],
        "window_hours": body["window_seconds"] / 3600,
    }


def index_context() -> dict[str, Any]:
    kept = {r.scope: r for r in AdvisorReport.objects.all()}
    pools = list(Pool.objects.filter(workers__isnull=False).distinct().order_by("name"))
    rows: list[dict[str, Any]] = []
    for scope, label in [(FLEET, "The whole fleet"), *((p.name, p.name) for p in pools)]:
        report = kept.get(scope)
        sentence = OVERALL_SENTENCES[report.overall] if report else "No report yet: open it to compute one."
        titles = _titles(report.body) if report else {}
        rows.append(
            {
                "scope": scope,
                "label": label,
                "report": report,
                "sentence": sentence,
                "overall_label": OVERALL_LABELS.get(report.overall, "") if report else "",
                "findings": [titles.get(key, _label(key)) for key in report.findings] if report else [],
            }
        )
    return {"rows": rows}


def _titles(body: Mapping[str, Any]) -> dict[str, str]:
    """Each answer's key to its title, for naming findings without their slugs."""
    answers = [
        *body.get("questions", []),
        body.get("head_of_line", {}),
        *body.get("tuning", []),
        body.get("pd", {}),
        body.get("pd_database") or {},
    ]
    return {a["key"]: a["title"] for a in answers if a}
