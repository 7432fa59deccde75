"""The experiment pages and their websockets; included from
``dashboards/urls.py`` and ``dashboards/routing.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.experiments import views
from dashboards.experiments.consumers import ExperimentConsumer, ExperimentListConsumer

urlpatterns: list[URLPattern | URLResolver] = [
    path("experiments/", views.experiment_list, name="experiments"),
    path("experiments/new/", views.experiment_new, name="experiment-new"),
    path("experiments/workloads/<int:pk>/", views.workload_detail, name="workload-detail"),
    path("experiments/<int:pk>/", views.experiment_detail, name="experiment-detail"),
    path("experiments/<int:pk>/<slug:verb>/", views.experiment_action, name="experiment-action"),
]

websocket_urlpatterns: list[URLPattern] = [
    path("ws/experiments/", ExperimentListConsumer.as_asgi(), name="ws-experiments"),
    path("ws/experiments/<int:pk>/", ExperimentConsumer.as_asgi(), name="ws-experiment"),
]
