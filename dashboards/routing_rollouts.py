"""Websocket routes of the rollout pages; included from ``dashboards/routing.py``."""

from django.urls import URLPattern, path

from dashboards.consumers_rollouts import RolloutConsumer, RolloutListConsumer

websocket_urlpatterns: list[URLPattern] = [
    path("ws/rollouts/", RolloutListConsumer.as_asgi(), name="ws-rollouts"),
    path("ws/rollouts/<int:pk>/", RolloutConsumer.as_asgi(), name="ws-rollout"),
]
