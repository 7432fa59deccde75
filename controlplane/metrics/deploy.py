"""The shipped Grafana dashboard and Prometheus rule file, generated from the
figure registry so that a fleet on its own Prometheus sees the figures the
control plane computes, by the same definitions.

``python manage.py export_deploy`` writes ``deploy/grafana/chunkpilot.json``
and ``deploy/prometheus/rules.yml``; a test fails when the checked-in files
drift from this module.

They work against the workers' own names (vLLM's, plus ``chunkpilot:*``).
The grouping labels ``pool``, ``cohort`` and ``worker`` come from the
control plane's HTTP service discovery (``/api/v1/metrics/prometheus-sd``),
which labels each worker target as the control plane groups it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from controlplane.metrics import figures
from controlplane.metrics.figures import Figure

GRAFANA_UID = "chunkpilot"
RULE_WINDOW = "5m"
RULE_GROUPING = "pool, cohort"
_METRIC = re.compile(r"((?:vllm|chunkpilot):[a-zA-Z0-9_:]+)(\{[^}]*\})?(?=\[)")


def expression(f: Figure, *, grouping: str, window: str, selector: str = "") -> str:
    """The figure's PromQL with its grouping and window filled in, and an
    optional label matcher added to every series it reads."""
    expr = f.promql.replace(figures.W, window)
    expr = re.sub(r"\bG\b", grouping, expr)
    if selector:
        def add(match: re.Match[str]) -> str:
            name, labels = match.group(1), match.group(2)
            if labels:
                return f"{name}{{{labels[1:-1]}, {selector}}}"
            return f"{name}{{{selector}}}"

        expr = _METRIC.sub(add, expr)
    return expr


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"(?:vllm|chunkpilot):[a-zA-Z0-9_:]+", expr))


# ---- Grafana ------------------------------------------------------------------------

_GRAFANA_UNITS = {"duration": "s", "percent": "percentunit", "times": "none", "rate": "reqps", "number": "none"}
_CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TTFT P99", ("ttft_p99",)),
    ("Memory peak/mean", ("memory_peak_to_mean",)),
    ("Prefill wait (mean, P99)", ("prefill_wait_mean", "prefill_wait_p99")),
    ("KV fragmentation", ("kv_fragmentation",)),
)
_BESIDE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ITL P99", ("itl_p99",)),
    ("Stalls P99 (largest gap per request)", ("stall_p99",)),
    ("TPOT (mean, P99)", ("tpot_mean", "tpot_p99")),
    ("Queue time (mean, P99)", ("queue_time_mean", "queue_time_p99")),
    ("Token mix per step", ("prefill_tokens_per_step", "decode_tokens_per_step")),
    ("Preemptions/s", ("preemptions_per_second",)),
    ("Prefix-cache hit rate", ("prefix_cache_hit_rate",)),
    ("Throughput", ("requests_per_second", "output_tokens_per_second")),
)


def _panel(panel_id: int, title: str, names: tuple[str, ...], x: int, y: int, width: int) -> dict[str, Any]:
    chosen = [figures.get(n) for n in names]
    unit = _GRAFANA_UNITS[chosen[0].display_kind]
    if chosen[0].unit == "tokens/s" or chosen[0].unit == "tokens/step":
        unit = "none"
    targets = []
    for i, f in enumerate(chosen):
        suffix = "" if len(chosen) == 1 else f" {f.label.split()[-1]}"
        targets.append({
            "refId": chr(ord("A") + i),
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "expr": expression(f, grouping="$group", window="$window", selector='pool=~"$pool"'),
            "legendFormat": "{{$group}}" + suffix,
        })
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": " ".join(f.description for f in chosen),
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"spanNulls": False}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi"}},
        "targets": targets,
    }


def grafana_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0

    def row(title: str) -> None:
        nonlocal next_id, y
        panels.append({"id": next_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id += 1
        y += 1

    row("The four figures: is chunked prefill tuned right?")
    for i, (title, names) in enumerate(_CHARTS):
        panels.append(_panel(next_id, title, names, x=(i % 2) * 12, y=y + (i // 2) * 8, width=12))
        next_id += 1
    y += 16
    row("Beside them")
    for i, (title, names) in enumerate(_BESIDE):
        panels.append(_panel(next_id, title, names, x=(i % 3) * 8, y=y + (i // 3) * 8, width=8))
        next_id += 1
    y += 8 * ((len(_BESIDE) + 2) // 3)
    row("Workers")
    panels.append({
        "id": next_id, "type": "timeseries", "title": "Requests running and waiting",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 0, "y": y},
        "fieldConfig": {"defaults": {"unit": "none"}, "overrides": []},
        "targets": [
            {"refId": "A", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "expr": 'sum by ($group) (vllm:num_requests_running{pool=~"$pool"})', "legendFormat": "{{$group}} running"},
            {"refId": "B", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "expr": 'sum by ($group) (vllm:num_requests_waiting{pool=~"$pool"})', "legendFormat": "{{$group}} waiting"},
        ],
    })
    panels.append({
        "id": next_id + 1, "type": "timeseries", "title": "KV cache usage",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12, "y": y},
        "fieldConfig": {"defaults": {"unit": "percentunit", "max": 1, "min": 0}, "overrides": []},
        "targets": [{"refId": "A", "datasource": {"type": "prometheus", "uid": "${datasource}"},
                     "expr": 'avg by ($group) (vllm:kv_cache_usage_perc{pool=~"$pool"})', "legendFormat": "{{$group}}"}],
    })

    def custom(name: str, label: str, options: list[str], current: str) -> dict[str, Any]:
        return {
            "name": name, "label": label, "type": "custom", "query": ",".join(options),
            "current": {"text": current, "value": current},
            "options": [{"text": o, "value": o, "selected": o == current} for o in options],
        }

    return {
        "uid": GRAFANA_UID,
        "title": "Chunkpilot: chunked prefill",
        "description": "Generated from controlplane/metrics/figures.py by `python manage.py export_deploy`.",
        "tags": ["chunkpilot", "vllm"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            custom("group", "per", ["cohort", "pool", "worker"], "cohort"),
            custom("window", "window", ["1m", "5m", "15m", "1h"], "5m"),
            {"name": "pool", "label": "pool", "type": "query", "includeAll": True, "multi": True, "allValue": ".*",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(vllm:num_requests_running, pool)", "refId": "pools"},
             "refresh": 2, "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


# ---- Prometheus rules ---------------------------------------------------------------------

# Alert thresholds are starting points: an operator tunes them to the fleet.
_ALERTS: list[dict[str, Any]] = [
    {
        "alert": "ChunkpilotWorkerDown",
        "expr": 'up{job="chunkpilot-workers"} == 0',
        "for": "1m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "Worker {{ $labels.worker }} does not answer /metrics.",
                        "description": "Prometheus has not scraped {{ $labels.instance }} for a minute."},
    },
    {
        "alert": "ChunkpilotTTFTP99High",
        "expr": f"chunkpilot:ttft_p99:{RULE_WINDOW} > 2",
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {"summary": "TTFT P99 of {{ $labels.cohort }} in {{ $labels.pool }} is {{ $value | humanizeDuration }}."},
    },
    {
        "alert": "ChunkpilotStallsHigh",
        "expr": f"chunkpilot:stall_p99:{RULE_WINDOW} > 1",
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {"summary": "Requests in {{ $labels.pool }} stall {{ $value | humanizeDuration }} at P99: "
                                   "head-of-line blocking (a monolithic prefill?)."},
    },
    {
        "alert": "ChunkpilotCanaryTTFTRegression",
        # Over 1.2x the stable cohort's P99 in the same pool's table, and above
        # an absolute floor of 100 ms (a ratio of two tiny numbers is noise).
        "expr": (
            f'(chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="canary"}} > on (pool) '
            f"(1.2 * chunkpilot:ttft_p99:{RULE_WINDOW}:by_pool_stable)) "
            f'and chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="canary"}} > 0.1'
        ),
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {"summary": "The canary's TTFT P99 is over 1.2× the stable cohort's."},
    },
    {
        "alert": "ChunkpilotKVFragmentationHigh",
        "expr": f"chunkpilot:kv_fragmentation:{RULE_WINDOW} > 0.5",
        "for": "15m",
        "labels": {"severity": "info"},
        "annotations": {"summary": "Half the KV blocks held in {{ $labels.pool }} are empty slots: block_size too large?"},
    },
    {
        "alert": "ChunkpilotPreemptions",
        "expr": f"chunkpilot:preemptions_per_second:{RULE_WINDOW} > 0.1",
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {"summary": "{{ $labels.pool }} preempts {{ $value }} requests/s: KV cache too small for the load."},
    },
    {
        "alert": "ChunkpilotControlPlaneScrapeFailing",
        "expr": "chunkpilot_worker_scrape_up == 0",
        "for": "2m",
        "labels": {"severity": "warn"},
        "annotations": {"summary": "The control plane cannot scrape {{ $labels.worker }}; its dashboards lack it."},
    },
]

RECORDED = ("ttft_p99", "memory_peak_to_mean", "prefill_wait_mean", "prefill_wait_p99", "kv_fragmentation",
            "itl_p99", "stall_p99", "tpot_p99", "queue_time_p99", "requests_per_second", "output_tokens_per_second",
            "prefill_tokens_per_step", "decode_tokens_per_step", "preemptions_per_second", "prefix_cache_hit_rate")


def prometheus_rules() -> dict[str, Any]:
    recording = [
        {"record": f"chunkpilot:{name}:{RULE_WINDOW}",
         "expr": expression(figures.get(name), grouping=RULE_GROUPING, window=RULE_WINDOW)}
        for name in RECORDED
    ]
    recording.append({
        "record": f"chunkpilot:ttft_p99:{RULE_WINDOW}:by_pool_stable",
        "expr": f'max by (pool) (chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="stable"}})',
    })
    return {"groups": [
        {"name": "chunkpilot-figures", "interval": "30s", "rules": recording},
        {"name": "chunkpilot-alerts", "rules": _ALERTS},
    ]}


HEADER = (
    "# Chunkpilot's figures as Prometheus recording rules, and starting-point alerts.\n"
    "# Generated from controlplane/metrics/figures.py by `python manage.py export_deploy`; do not edit.\n"
    "# Worker targets carry pool, cohort and worker labels from the control plane's\n"
    "# HTTP service discovery: see deploy/prometheus/README.md.\n"
)


def rules_yaml() -> str:
    return HEADER + yaml.safe_dump(prometheus_rules(), sort_keys=False, width=120, allow_unicode=True)


def dashboard_json() -> str:
    return json.dumps(grafana_dashboard(), indent=2, ensure_ascii=False) + "\n"
