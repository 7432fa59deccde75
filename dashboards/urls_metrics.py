"""The metric pages (``/figures/...``) and the control plane's Prometheus
``/metrics``; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path, re_path

from controlplane.metrics.api import PrometheusView
from dashboards import views_metrics

urlpatterns: list[URLPattern | URLResolver] = [
    re_path(r"^metrics/?$", PrometheusView.as_view(), name="prometheus-metrics"),
    path("figures/", views_metrics.overview, name="metrics-overview"),
    path("figures/panel/", views_metrics.panel, name="metrics-panel"),
    path("figures/cohorts/", views_metrics.cohorts, name="metrics-cohorts"),
    path("figures/lengths/", views_metrics.lengths, name="metrics-lengths"),
    path("figures/worker/<int:pk>/", views_metrics.worker, name="metrics-worker"),
    path("figures/objectives/", views_metrics.objectives, name="metrics-objectives"),
]
