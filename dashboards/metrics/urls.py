"""The metric pages (``/figures/...``) and their websockets; included from
``dashboards/urls.py`` and ``dashboards/routing.py``. (The control plane's
own Prometheus ``/metrics`` is no page: ``controlplane/urls.py`` routes it.)"""

from django.urls import URLPattern, URLResolver, path

from dashboards.metrics import views
from dashboards.metrics.consumers import (
    CohortsConsumer,
    LengthsConsumer,
    OverviewConsumer,
    PanelConsumer,
    WorkerConsumer,
)

urlpatterns: list[URLPattern | URLResolver] = [
    path("figures/", views.overview, name="metrics-overview"),
    path("figures/panel/", views.panel, name="metrics-panel"),
    path("figures/cohorts/", views.cohorts, name="metrics-cohorts"),
    path("figures/lengths/", views.lengths, name="metrics-lengths"),
    path("figures/worker/<int:pk>/", views.worker, name="metrics-worker"),
    path("figures/objectives/", views.objectives, name="metrics-objectives"),
]

websocket_urlpatterns: list[URLPattern] = [
    path("ws/metrics/overview/", OverviewConsumer.as_asgi(), name="ws-metrics-overview"),
    path("ws/metrics/panel/", PanelConsumer.as_asgi(), name="ws-metrics-panel"),
    path("ws/metrics/cohorts/", CohortsConsumer.as_asgi(), name="ws-metrics-cohorts"),
    path("ws/metrics/lengths/", LengthsConsumer.as_asgi(), name="ws-metrics-lengths"),
    path("ws/metrics/worker/<int:pk>/", WorkerConsumer.as_asgi(), name="ws-metrics-worker"),
]
