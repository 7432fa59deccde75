"""The advisor's API: the kept reports, and a report over any window on demand.

    GET /api/v1/advisor/reports/                      every kept report (pools and the fleet), in brief
    GET /api/v1/advisor/reports/{scope}/[?window=1h][&end=…]  one in full: a pool's name or "fleet"; with a
                                                      window or an end (ISO time or epoch seconds), computed
                                                      over the window ending then (not kept)

Bad input answers 400 naming the parameter; an unknown pool 404; a metrics
backend that does not answer (Prometheus down or slow) 503, as the metrics
API does.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.advisor import conf
from controlplane.advisor.models import FLEET, AdvisorReport, compute
from controlplane.fleet.models import Pool
from controlplane.metrics import query
from controlplane.metrics.api import parse_time, unavailable


def brief(report: AdvisorReport) -> dict[str, object]:
    return {
        "scope": report.scope,
        "overall": report.overall,
        "findings": report.findings,
        "appeared": report.appeared,
        "findings_changed_at": report.findings_changed_at.isoformat() if report.findings_changed_at else None,
        "computed_at": report.computed_at.isoformat(),
        "window_seconds": report.window_seconds,
    }


class ReportsView(APIView):
    @extend_schema(summary="The kept advisor reports, per pool and for the fleet", responses={200: dict})
    def get(self, request: Request) -> Response:
        return Response({"reports": [brief(r) for r in AdvisorReport.objects.all()]})


class ReportView(APIView):
    @extend_schema(
        summary="One advisor report: does this traffic need chunked prefill, with which knobs, is it tuned right",
        parameters=[
            OpenApiParameter("scope", str, OpenApiParameter.PATH, description='a pool\'s name, or "fleet"'),
            OpenApiParameter(
                "window",
                str,
                description="e.g. 15m, 1h, 1d: compute now over it (default: the "
                "kept report, computed now if there is none)",
            ),
            OpenApiParameter(
                "end",
                str,
                description="ISO time or epoch seconds: judge the window ending then (default now; with no "
                "window, the kept report's window)",
            ),
        ],
        responses={200: dict},
    )
    def get(self, request: Request, scope: str) -> Response:
        pool = None
        if scope != FLEET:
            pool = Pool.objects.select_related("desired_revision").filter(name=scope).first()
            if pool is None:
                return Response({"scope": [f"no pool named {scope!r}"]}, status=404)
        text = request.query_params.get("window")
        try:
            end = parse_time(request.query_params.get("end"), "end")
            window = query.check_window(query.parse_duration(text, "window")) if text else 0.0
        except query.QueryError as exc:
            return Response({exc.field: [exc.message]}, status=400)
        try:
            if text or end is not None:
                window = window or conf.ADVISOR_WINDOW_SECONDS.get()
                return Response({**compute(pool, window, end or timezone.now()), "kept": False})
            report = AdvisorReport.objects.filter(scope=scope).first() or AdvisorReport.refresh(pool)
        except query.BackendUnavailable as exc:
            return unavailable(exc)
        return Response({**report.body, "kept": True, **brief(report)})
