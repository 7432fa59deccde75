from django.urls import URLPattern, URLResolver, re_path

from controlplane.metrics.api import (
    FiguresView,
    ObjectivesView,
    PrometheusSDView,
    QueryRangeView,
    QueryView,
    TargetsView,
)

# The paths answer with or without a trailing slash (the issue names them without).
urlpatterns: list[URLPattern | URLResolver] = [
    re_path(r"^metrics/figures/?$", FiguresView.as_view(), name="metrics-figures"),
    re_path(r"^metrics/query/?$", QueryView.as_view(), name="metrics-query"),
    re_path(r"^metrics/query_range/?$", QueryRangeView.as_view(), name="metrics-query-range"),
    re_path(r"^metrics/objectives/?$", ObjectivesView.as_view(), name="metrics-objectives"),
    re_path(r"^metrics/targets/?$", TargetsView.as_view(), name="metrics-targets"),
    re_path(r"^metrics/prometheus-sd/?$", PrometheusSDView.as_view(), name="metrics-prometheus-sd"),
]
