"""Websocket routes, one Channels consumer per live view."""

from django.urls import URLPattern, path

from dashboards.consumers import FleetConsumer

websocket_urlpatterns: list[URLPattern] = [
    path("ws/fleet/", FleetConsumer.as_asgi(), name="ws-fleet"),
]
