"""Websocket routes, one Channels consumer per live view."""

from django.urls import URLPattern, path

from dashboards.consumers import FleetConsumer
from dashboards.routing_metrics import websocket_urlpatterns as metrics_websocket_urlpatterns
from dashboards.routing_rollouts import websocket_urlpatterns as rollouts_websocket_urlpatterns

websocket_urlpatterns: list[URLPattern] = [
    path("ws/fleet/", FleetConsumer.as_asgi(), name="ws-fleet"),
    *metrics_websocket_urlpatterns,
    *rollouts_websocket_urlpatterns,
]
