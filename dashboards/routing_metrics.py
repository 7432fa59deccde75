"""Websocket routes of the metric pages; included from ``dashboards/routing.py``."""

from django.urls import URLPattern, path

from dashboards.consumers_metrics import (
    CohortsConsumer,
    LengthsConsumer,
    OverviewConsumer,
    PanelConsumer,
    WorkerConsumer,
)

websocket_urlpatterns: list[URLPattern] = [
    path("ws/metrics/overview/", OverviewConsumer.as_asgi(), name="ws-metrics-overview"),
    path("ws/metrics/panel/", PanelConsumer.as_asgi(), name="ws-metrics-panel"),
    path("ws/metrics/cohorts/", CohortsConsumer.as_asgi(), name="ws-metrics-cohorts"),
    path("ws/metrics/lengths/", LengthsConsumer.as_asgi(), name="ws-metrics-lengths"),
    path("ws/metrics/worker/<int:pk>/", WorkerConsumer.as_asgi(), name="ws-metrics-worker"),
]
