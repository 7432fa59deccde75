"""The shipped Grafana dashboard, Prometheus scrape config and rule file and
Alertmanager config, generated from the figure registry so that a fleet on
its own Prometheus sees the figures the control plane computes, by the same
definitions.

``python manage.py export_deploy`` writes ``deploy/grafana/chunkpilot.json``,
``deploy/prometheus/{prometheus.yml, rules.yml, rules.test.yml}`` (the last
from ``rule_tests``; ``shipped.files`` lists them all) and
``deploy/alertmanager/alertmanager.yml``; a test
fails when the checked-in files drift from this module, and the tests run
promtool and amtool on them.

They work against the workers' own names (vLLM's, plus ``chunkpilot:*``).
The grouping labels ``pool``, ``cohort`` and ``worker`` come from the
control plane's HTTP service discovery (``/api/v1/metrics/prometheus-sd``),
which labels each worker target as the control plane groups it; every
worker series also carries ``model_name``, which names the routing table a
canary is judged in.
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
# model_name: a canary and the stable pool it is judged against are two pools
# serving one model (one routing table); grouping by it costs no series,
# since a pool serves one model.
RULE_GROUPING = "model_name, pool, cohort"
# The label that asks Chunkpilot's inbound Alertmanager webhook to abort the
# rollout that owns the alert's canary pool: alerts.models' ACTION_LABEL and
# ACTION_ABORT, spelled out because metrics sits below alerts (a test holds
# them equal).
ACTION_LABEL, ACTION_ABORT = "chunkpilot_action", "abort_rollout"
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


def _panel(panel_id: int, title: str, names: tuple[str, ...], x: int, y: int, width: int) -> dict[str, Any]:
    chosen = [figures.get(n) for n in names]
    unit = _GRAFANA_UNITS[chosen[0].display_kind]
    if chosen[0].unit == "tokens/s" or chosen[0].unit == "tokens/step":
        unit = "none"
    targets = []
    last_words = [f.label.split()[-1] for f in chosen]
    for i, f in enumerate(chosen):
        # One word tells them apart (mean, P99), else the whole label.
        word = last_words[i] if len(set(last_words)) == len(chosen) else f.label
        suffix = "" if len(chosen) == 1 else f" {word}"
        targets.append(
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expression(f, grouping="$group", window="$window", selector='pool=~"$pool"'),
                "legendFormat": "{{$group}}" + suffix,
            }
        )
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": " ".join(f.description for f in chosen),
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"spanNulls": False}}, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi"},
        },
        "targets": targets,
    }


def grafana_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0

    def row(title: str) -> None:
        nonlocal next_id, y
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1

    row("The four figures: is chunked prefill tuned right?")
    for i, chart in enumerate(figures.PANEL_CHARTS):
        panels.append(_panel(next_id, chart.title, chart.figures, x=(i % 2) * 12, y=y + (i // 2) * 8, width=12))
        next_id += 1
    y += 16
    row("Beside them")
    for i, chart in enumerate(figures.BESIDE_CHARTS):
        panels.append(_panel(next_id, chart.title, chart.figures, x=(i % 3) * 8, y=y + (i // 3) * 8, width=8))
        next_id += 1
    y += 8 * ((len(figures.BESIDE_CHARTS) + 2) // 3)
    row("Workers")
    panels.append(
        {
            "id": next_id,
            "type": "timeseries",
            "title": "Requests running and waiting",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 0, "y": y},
            "fieldConfig": {"defaults": {"unit": "none"}, "overrides": []},
            "targets": [
                {
                    "refId": "A",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "expr": 'sum by ($group) (vllm:num_requests_running{pool=~"$pool"})',
                    "legendFormat": "{{$group}} running",
                },
                {
                    "refId": "B",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "expr": 'sum by ($group) (vllm:num_requests_waiting{pool=~"$pool"})',
                    "legendFormat": "{{$group}} waiting",
                },
            ],
        }
    )
    panels.append(
        {
            "id": next_id + 1,
            "type": "timeseries",
            "title": "KV cache usage",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12, "y": y},
            "fieldConfig": {"defaults": {"unit": "percentunit", "max": 1, "min": 0}, "overrides": []},
            "targets": [
                {
                    "refId": "A",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "expr": 'avg by ($group) (vllm:kv_cache_usage_perc{pool=~"$pool"})',
                    "legendFormat": "{{$group}}",
                }
            ],
        }
    )

    def custom(name: str, label: str, options: list[str], current: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "custom",
            "query": ",".join(options),
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
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
                custom("group", "per", ["cohort", "pool", "worker"], "cohort"),
                custom("window", "window", ["1m", "5m", "15m", "1h"], "5m"),
                {
                    "name": "pool",
                    "label": "pool",
                    "type": "query",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": "label_values(vllm:num_requests_running, pool)", "refId": "pools"},
                    "refresh": 2,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
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
        "annotations": {
            "summary": "Worker {{ $labels.worker }} does not answer /metrics.",
            "description": "Prometheus has not scraped {{ $labels.instance }} for a minute.",
        },
    },
    {
        "alert": "ChunkpilotTTFTP99High",
        "expr": f"chunkpilot:ttft_p99:{RULE_WINDOW} > 2",
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {
            "summary": "TTFT P99 of {{ $labels.cohort }} in {{ $labels.pool }} is {{ $value | humanizeDuration }}."
        },
    },
    {
        "alert": "ChunkpilotStallsHigh",
        "expr": f"chunkpilot:stall_p99:{RULE_WINDOW} > 1",
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {
            "summary": "Requests in {{ $labels.pool }} stall {{ $value | humanizeDuration }} at P99: "
            "head-of-line blocking (a monolithic prefill?)."
        },
    },
    {
        "alert": "ChunkpilotCanaryTTFTRegression",
        # Over 1.2x the P99 of the cohort the canary is judged against in the
        # same model's routing table, and above an absolute floor of 100 ms
        # (a ratio of two tiny numbers is noise). Its action label sends it
        # through Alertmanager to Chunkpilot's webhook, which aborts the
        # rollout that owns the canary pool (see deploy/alertmanager/).
        "expr": (
            f'(chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="canary"}} > on (model_name) group_left () '
            f"(1.2 * chunkpilot:ttft_p99:{RULE_WINDOW}:reference)) "
            f'and chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="canary"}} > 0.1'
        ),
        "for": "10m",
        "labels": {"severity": "warn", ACTION_LABEL: ACTION_ABORT},
        "annotations": {
            "summary": "The TTFT P99 of canary {{ $labels.pool }} is {{ $value | humanizeDuration }}, "
            "over 1.2× its baseline's: Chunkpilot aborts the rollout that owns it."
        },
    },
    {
        "alert": "ChunkpilotKVFragmentationHigh",
        "expr": f"chunkpilot:kv_fragmentation:{RULE_WINDOW} > 0.5",
        "for": "15m",
        "labels": {"severity": "info"},
        "annotations": {
            "summary": "Half the KV blocks held in {{ $labels.pool }} are empty slots: block_size too large?"
        },
    },
    {
        "alert": "ChunkpilotPreemptions",
        "expr": f"chunkpilot:preemptions_per_second:{RULE_WINDOW} > 0.1",
        "for": "10m",
        "labels": {"severity": "warn"},
        "annotations": {
            "summary": "{{ $labels.pool }} preempts {{ $value }} requests/s: KV cache too small for the load."
        },
    },
    {
        "alert": "ChunkpilotCanaryStreamsSilent",
        # Streams in flight in a canary with no token for GATEWAY_STREAM_SILENCE_SECONDS,
        # as every live gateway reports them to the control plane's /metrics.
        # A wedged chunk scheduler shows up here long before those requests
        # would finish (if they ever do); the action label aborts the rollout.
        "expr": 'sum by (model, pool) (chunkpilot_gateway_streams_silent{cohort="canary"}) > 0',
        "for": "1m",
        "labels": {"severity": "critical", ACTION_LABEL: ACTION_ABORT},
        "annotations": {
            "summary": "{{ $value }} streams of canary {{ $labels.pool }} have had no token for "
            "GATEWAY_STREAM_SILENCE_SECONDS: Chunkpilot aborts the rollout that owns it."
        },
    },
    {
        "alert": "ChunkpilotControlPlaneScrapeFailing",
        "expr": "chunkpilot_worker_scrape_up == 0",
        "for": "2m",
        "labels": {"severity": "warn"},
        "annotations": {"summary": "The control plane cannot scrape {{ $labels.worker }}; its dashboards lack it."},
    },
]

RECORDED = (
    "ttft_p99",
    "memory_peak_to_mean",
    "prefill_wait_mean",
    "prefill_wait_p99",
    "kv_fragmentation",
    "itl_p99",
    "stall_p99",
    "tpot_p99",
    "queue_time_p99",
    "requests_per_second",
    "output_tokens_per_second",
    "prefill_tokens_per_step",
    "decode_tokens_per_step",
    "preemptions_per_second",
    "prefix_cache_hit_rate",
    "ttft_samples",
    "stall_samples",
    "engine_stall_p99",
    "delivery_lag_p99",
    "merged_deltas_per_second",
)


def prometheus_rules() -> dict[str, Any]:
    recording = [
        {
            "record": f"chunkpilot:{name}:{RULE_WINDOW}",
            "expr": expression(figures.get(name), grouping=RULE_GROUPING, window=RULE_WINDOW),
        }
        for name in RECORDED
    ]
    # What a canary is judged against, per model: its table's baseline cohort
    # where it has one, else its stable cohort (the control plane's own
    # canary rule does the same).
    recording.append(
        {
            "record": f"chunkpilot:ttft_p99:{RULE_WINDOW}:reference",
            "expr": f'max by (model_name) (chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="baseline"}}) '
            f'or max by (model_name) (chunkpilot:ttft_p99:{RULE_WINDOW}{{cohort="stable"}})',
        }
    )
    return {
        "groups": [
            {"name": "chunkpilot-figures", "interval": "30s", "rules": recording},
            {"name": "chunkpilot-alerts", "rules": _ALERTS},
        ]
    }


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


# ---- Prometheus and Alertmanager configs -------------------------------------------

# Placeholders an operator replaces (and the tests template): the control
# plane's URL, and an API token in a file beside each config (a viewer's for
# Prometheus, an operator's for Alertmanager, whose webhook acts).
EXAMPLE_URL = "https://chunkpilot.example.com"
TOKEN_FILE = "chunkpilot-token"
SD_PATH = "/api/v1/metrics/prometheus-sd"
WEBHOOK_PATH = "/api/v1/alerts/webhook/"
WORKERS_JOB = "chunkpilot-workers"
CONTROL_PLANE_JOB = "chunkpilot-control-plane"
WEBHOOK_RECEIVER = "chunkpilot"


def _token() -> dict[str, str]:
    return {"type": "Token", "credentials_file": TOKEN_FILE}


def prometheus_config() -> dict[str, Any]:
    host = EXAMPLE_URL.split("://", 1)[1]
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "30s"},
        "rule_files": ["rules.yml"],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": ["localhost:9093"]}]}]},
        "scrape_configs": [
            {
                "job_name": WORKERS_JOB,
                # Shorter than the figures' windows by far, and than the 15 s
                # the recent-peak gauge holds a peak, so no peak falls between scrapes.
                "scrape_interval": "5s",
                "http_sd_configs": [
                    {"url": EXAMPLE_URL + SD_PATH, "refresh_interval": "30s", "authorization": _token()}
                ],
            },
            {
                "job_name": CONTROL_PLANE_JOB,
                "metrics_path": "/metrics",
                "scheme": EXAMPLE_URL.split("://", 1)[0],
                "static_configs": [{"targets": [f"{host}:443"]}],
                "authorization": _token(),
            },
        ],
    }


def alertmanager_config() -> dict[str, Any]:
    return {
        "route": {
            "receiver": "operators",
            "group_by": ["alertname", "model_name", "pool", "cohort"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            "routes": [
                # Alerts that act go to Chunkpilot at once (it acts once per
                # fingerprint and start, however often they repeat), and on
                # to the operators' receiver too.
                {
                    "receiver": WEBHOOK_RECEIVER,
                    "matchers": [f'{ACTION_LABEL}="{ACTION_ABORT}"'],
                    "group_wait": "0s",
                    "group_interval": "30s",
                    "repeat_interval": "5m",
                    "continue": True,
                },
                {"receiver": "operators"},
            ],
        },
        "receivers": [
            {"name": "operators"},
            {
                "name": WEBHOOK_RECEIVER,
                "webhook_configs": [
                    {
                        "url": EXAMPLE_URL + WEBHOOK_PATH,
                        "send_resolved": True,
                        "http_config": {"authorization": _token()},
                    },
                ],
            },
        ],
    }


PROMETHEUS_HEADER = (
    "# Prometheus scraping a Chunkpilot fleet: the workers as the control plane's HTTP service\n"
    "# discovery lists them (labelled worker, pool, cohort), the control plane's own /metrics, the\n"
    "# shipped rules, and an Alertmanager. Generated by `python manage.py export_deploy`.\n"
    f"# Replace {EXAMPLE_URL} with your control plane, put a viewer's API token in\n"
    f"# {TOKEN_FILE} beside this file (`python manage.py createapitoken`), and point alerting\n"
    "# at your Alertmanager. See README.md.\n"
)
ALERTMANAGER_HEADER = (
    '# Alertmanager routing Chunkpilot\'s acting alerts (chunkpilot_action="abort_rollout") to its\n'
    "# webhook, which aborts the rollout that owns the canary pool. Generated by\n"
    f"# `python manage.py export_deploy`. Replace {EXAMPLE_URL} with your control plane, put an\n"
    f"# operator's API token in {TOKEN_FILE} beside this file, and give the operators receiver\n"
    "# your pager, email or chat.\n"
)


def _yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True)


def prometheus_yaml() -> str:
    return PROMETHEUS_HEADER + _yaml(prometheus_config())


def alertmanager_yaml() -> str:
    return ALERTMANAGER_HEADER + _yaml(alertmanager_config())
