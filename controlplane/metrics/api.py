"""The metrics API: the figure registry, one-window queries, time series,
the operator's objectives and each worker's scrape status.

    GET /api/v1/metrics/figures
    GET /api/v1/metrics/query?figure=ttft_p99&window=5m&group_by=cohort[&pool=..][&cohort=..][&worker=..]
    GET /api/v1/metrics/query_range?figure=ttft_p99&window=5m&group_by=pool&range=1h&step=1m
    GET|PUT /api/v1/metrics/objectives
    GET /api/v1/metrics/targets

A percentile's answer says what it rests on: ``quantile``, its
``percentile_rule`` (nearest rank over the request log, Prometheus'
``histogram_quantile`` over scrapes), ``samples`` per group (per point for a
series) and ``few_samples`` where they are too few for it (a P99 over fewer
than 100: the slowest request decides it).

Bad input answers 400 naming the parameter: ``{"window": ["..."]}``; a
metrics backend (Prometheus) that does not answer, 503 with
``{"detail": "metrics backend unavailable: ..."}``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane import outages
from controlplane.accounts.inputs import StrictModelSerializer
from controlplane.fleet.models import Worker
from controlplane.metrics import exposition, figures, query
from controlplane.metrics.figures import Objectives
from controlplane.metrics.models import ScrapeRound, ScrapeStatus, ServiceObjectives
from controlplane.metrics.scrape import cohorts_by_pool

log = logging.getLogger(__name__)

SELECTOR_PARAMS = [OpenApiParameter(key, str, description=f"only this {key}") for key in query.SELECTOR_KEYS]
COMMON_PARAMS = [
    OpenApiParameter("figure", str, required=True, description="a figure name from /metrics/figures"),
    OpenApiParameter("window", str, description="e.g. 30s, 5m, 1h (default 5m)"),
    OpenApiParameter("group_by", str, description="fleet, worker, pool, cohort; length_bucket for client_* figures"),
    OpenApiParameter("ttft_slo", float, description="goodput's TTFT objective in seconds (default: the stored one)"),
    OpenApiParameter("tpot_slo", float, description="goodput's TPOT objective in seconds (default: the stored one)"),
    *SELECTOR_PARAMS,
]


def _bad(exc: query.QueryError) -> Response:
    return Response({exc.field: [exc.message]}, status=400)


def unavailable(exc: query.BackendUnavailable) -> Response:
    """Prometheus down or slow: an outage of the metrics backend, not a bug (one log line, no traceback)."""
    log.warning("%s", exc)
    return outages.quiet(
        Response(
            {"detail": str(exc), "unavailable": "metrics_backend", "retry_after_seconds": 5},
            status=503,
            headers={"Retry-After": "5"},
        )
    )


def _common(request: Request) -> dict[str, Any]:
    params = request.query_params
    if not params.get("figure"):
        raise query.QueryError("figure", "required; one of " + ", ".join(figures.FIGURES))
    figure = query.figure_named(params["figure"])
    window = query.parse_duration(params.get("window", "5m"), "window")
    group_by = query.check_group_by(figure, params.get("group_by") or query.FLEET)
    selector = {key: params[key] for key in query.SELECTOR_KEYS if params.get(key)}
    objectives = None
    if params.get("ttft_slo") or params.get("tpot_slo"):
        stored = ServiceObjectives.current()
        objectives = Objectives(
            _positive(params.get("ttft_slo"), "ttft_slo", stored.ttft_seconds),
            _positive(params.get("tpot_slo"), "tpot_slo", stored.tpot_seconds),
        )
    return {"figure": figure, "window": window, "group_by": group_by, "selector": selector, "objectives": objectives}


def _positive(text: str | None, field: str, default: float) -> float:
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise query.QueryError(field, "must be a number of seconds") from None
    if not value > 0:
        raise query.QueryError(field, "must be positive")
    return value


class FiguresView(APIView):
    @extend_schema(summary="The figure registry", responses={200: dict})
    def get(self, request: Request) -> Response:
        return Response(
            {
                "figures": [
                    {**f.describe(), **f.percentile_info(), "group_by": list(figures.group_by_choices(f))}
                    for f in figures.FIGURES.values()
                ],
                "panel": list(figures.PANEL_FIGURES),
                "percentile_rules": figures.PERCENTILE_RULES,
                "length_buckets": list(query.catalogue.LENGTH_BUCKET_LABELS),
            }
        )


class QueryView(APIView):
    @extend_schema(summary="A figure over one window, per group", parameters=COMMON_PARAMS, responses={200: dict})
    def get(self, request: Request) -> Response:
        now = timezone.now()
        try:
            args = _common(request)
            f = args["figure"]
            names = [f.name, f.samples] if f.samples else [f.name]
            both = query.query_many(names, args["window"], args["group_by"], args["selector"], now, args["objectives"])
        except query.QueryError as exc:
            return _bad(exc)
        except query.BackendUnavailable as exc:
            return unavailable(exc)
        values = both[f.name]
        out: dict[str, Any] = {
            "figure": f.name,
            "unit": f.unit,
            "direction": f.direction.value,
            "window_seconds": args["window"],
            "group_by": args["group_by"],
            "at": now.isoformat(),
            "values": values,
        }
        if f.samples:
            samples = {group: both[f.samples].get(group) for group in values}
            out.update(_percentile_fields(f))
            out["samples"] = samples
            out["few_samples"] = {group: figures.few_samples(f.quantile, n) for group, n in samples.items()}
        return Response(out)


def _percentile_fields(f: figures.Figure) -> dict[str, Any]:
    """What a percentile's answer says about itself: which, by which rule, and what counts its samples."""
    return f.percentile_info()


class QueryRangeView(APIView):
    @extend_schema(
        summary="A figure as a time series, per group",
        parameters=[
            *COMMON_PARAMS,
            OpenApiParameter("range", str, description="how far back from end (default 1h)"),
            OpenApiParameter("step", str, description="between points (default: range/120, at least 1m)"),
            OpenApiParameter("end", str, description="ISO time or epoch seconds (default now)"),
        ],
        responses={200: dict},
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        try:
            args = _common(request)
            end = parse_time(params.get("end"), "end") or timezone.now()
            span = query.parse_duration(params.get("range", "1h"), "range")
            step = query.parse_duration(params["step"], "step") if params.get("step") else max(60.0, span / 120)
            f = args["figure"]
            results = query.query_range_many(
                [f.name, f.samples] if f.samples else [f.name],
                args["window"],
                args["group_by"],
                args["selector"],
                start=end - timedelta(seconds=span),
                end=end,
                step_seconds=step,
                objectives=args["objectives"],
            )
        except query.QueryError as exc:
            return _bad(exc)
        except query.BackendUnavailable as exc:
            return unavailable(exc)
        result = results[f.name]
        out: dict[str, Any] = {
            "figure": f.name,
            "unit": f.unit,
            "direction": f.direction.value,
            "window_seconds": args["window"],
            "group_by": args["group_by"],
            "step_seconds": step,
            "times": result.times,
            "series": result.series,
        }
        if f.samples:
            counted = results[f.samples].series
            samples = {group: counted.get(group, [None] * len(result.times)) for group in result.series}
            out.update(_percentile_fields(f))
            out["samples"] = samples
            out["few_samples"] = {
                group: [figures.few_samples(f.quantile, n) for n in counts] for group, counts in samples.items()
            }
        return Response(out)


# Times a query may end at: a range back from them must still be a datetime.
EARLIEST_END = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_END = datetime(9000, 1, 1, tzinfo=UTC)


def parse_time(text: str | None, field: str) -> datetime | None:
    if not text:
        return None
    out_of_range = query.QueryError(field, f"must be between {EARLIEST_END:%Y} and {LATEST_END:%Y}")
    try:
        seconds = float(text)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise query.QueryError(field, "an ISO 8601 time or epoch seconds") from None
        parsed = parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
        if not EARLIEST_END <= parsed <= LATEST_END:
            raise out_of_range from None
        return parsed
    if not EARLIEST_END.timestamp() <= seconds <= LATEST_END.timestamp():  # nan and inf too
        raise out_of_range
    return datetime.fromtimestamp(seconds, tz=UTC)


class ObjectivesSerializer(StrictModelSerializer):
    ttft_seconds = serializers.FloatField(min_value=0.001, max_value=3600)
    tpot_seconds = serializers.FloatField(min_value=0.0001, max_value=600)

    class Meta:
        model = ServiceObjectives
        fields = ["ttft_seconds", "tpot_seconds", "updated_at"]
        read_only_fields = ["updated_at"]


class ObjectivesView(APIView):
    """The TTFT and TPOT objectives goodput counts against. Operators change them."""

    @extend_schema(summary="Goodput's objectives", responses={200: ObjectivesSerializer})
    def get(self, request: Request) -> Response:
        return Response(ObjectivesSerializer(ServiceObjectives.current()).data)

    @extend_schema(
        summary="Set goodput's objectives", request=ObjectivesSerializer, responses={200: ObjectivesSerializer}
    )
    def put(self, request: Request) -> Response:
        row = ServiceObjectives.current()
        serializer = ObjectivesSerializer(row, data=request.data)
        serializer.is_valid(raise_exception=True)
        row.change(
            serializer.validated_data["ttft_seconds"], serializer.validated_data["tpot_seconds"], actor=request.user
        )
        return Response(ObjectivesSerializer(row).data)


class TargetsView(APIView):
    @extend_schema(summary="Each worker's last scrape", responses={200: dict})
    def get(self, request: Request) -> Response:
        latest = ScrapeRound.latest()
        return Response(
            {
                "last_round_at": latest.started_at.isoformat() if latest else None,
                "workers": [
                    {
                        "worker": s.worker.name,
                        "up": s.up,
                        "last_attempt_at": s.last_attempt_at,
                        "last_success_at": s.last_success_at,
                        "last_duration_seconds": s.last_duration_seconds,
                        "last_error": s.last_error,
                        "num_consecutive_failures": s.num_consecutive_failures,
                    }
                    for s in ScrapeStatus.objects.select_related("worker").order_by("worker__name")
                ],
            }
        )


class _PrometheusText(BaseRenderer):
    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        return data if isinstance(data, bytes) else str(data).encode()


class PrometheusView(APIView):
    """The control plane's own /metrics for a fleet's Prometheus: fleet,
    scrape, objective and routing gauges, plus registered providers
    (``controlplane.metrics.exposition``). Viewer role: a Prometheus job
    authenticates with an API token (``authorization: {type: Token,
    credentials: ...}``)."""

    renderer_classes = [_PrometheusText]

    @extend_schema(summary="Prometheus exposition of the control plane", responses={(200, "text/plain"): str})
    def get(self, request: Request) -> HttpResponse:
        return HttpResponse(exposition.render(), content_type=exposition.CONTENT_TYPE)


class PrometheusSDView(APIView):
    """Prometheus HTTP service discovery: every registered worker as a target,
    labelled with the worker, its pool and its cohort (the pool's role in the
    routing table), so the shipped rules and dashboard group as the control
    plane does. Use with ``http_sd_configs`` (see deploy/prometheus/README.md)."""

    @extend_schema(
        summary="Worker targets for Prometheus's http_sd_configs",
        responses={
            200: inline_serializer(
                "PrometheusTargetGroup",
                {
                    "targets": serializers.ListField(child=serializers.CharField(), help_text="host:port"),
                    "labels": serializers.DictField(child=serializers.CharField()),
                },
                many=True,
            )
        },
    )
    def get(self, request: Request) -> Response:
        from urllib.parse import urlsplit

        cohorts = cohorts_by_pool()
        groups = []
        for w in Worker.objects.select_related("pool").order_by("name"):
            url = urlsplit(w.url)
            if not url.hostname:
                continue
            host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
            port = url.port or (443 if url.scheme == "https" else 80)
            groups.append(
                {
                    "targets": [f"{host}:{port}"],
                    "labels": {
                        "__scheme__": url.scheme or "http",
                        "__metrics_path__": url.path.rstrip("/") + "/metrics",
                        "worker": w.name,
                        "pool": w.pool.name if w.pool else "",
                        "cohort": cohorts.get(w.pool_id, "") if w.pool_id else "",
                    },
                }
            )
        return Response(groups)
