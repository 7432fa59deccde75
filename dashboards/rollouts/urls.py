"""The rollout pages and their websockets; included from
``dashboards/urls.py`` and ``dashboards/routing.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.rollouts import views
from dashboards.rollouts.consumers import RolloutConsumer, RolloutListConsumer

urlpatterns: list[URLPattern | URLResolver] = [
    path("rollouts/", views.rollout_list, name="rollouts"),
    path("rollouts/new/", views.rollout_new, name="rollout-new"),
    path("rollouts/<int:pk>/", views.rollout_detail, name="rollout-detail"),
    path("rollouts/<int:pk>/<slug:verb>/", views.rollout_action, name="rollout-action"),
]

websocket_urlpatterns: list[URLPattern] = [
    path("ws/rollouts/", RolloutListConsumer.as_asgi(), name="ws-rollouts"),
    path("ws/rollouts/<int:pk>/", RolloutConsumer.as_asgi(), name="ws-rollout"),
]
