"""The fleet pages and their websocket; included from ``dashboards/urls.py``
and ``dashboards/routing.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.fleet import views
from dashboards.fleet.consumers import FleetConsumer

urlpatterns: list[URLPattern | URLResolver] = [
    path("", views.fleet, name="fleet"),
    path("workers/<int:pk>/", views.worker_detail, name="worker-detail"),
    path("workers/<int:pk>/<slug:verb>/", views.worker_action, name="worker-action"),
]

websocket_urlpatterns: list[URLPattern] = [
    path("ws/fleet/", FleetConsumer.as_asgi(), name="ws-fleet"),
]
