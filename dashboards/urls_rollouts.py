"""The rollout pages; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards import views_rollouts

urlpatterns: list[URLPattern | URLResolver] = [
    path("rollouts/", views_rollouts.rollout_list, name="rollouts"),
    path("rollouts/new/", views_rollouts.rollout_new, name="rollout-new"),
    path("rollouts/<int:pk>/", views_rollouts.rollout_detail, name="rollout-detail"),
    path("rollouts/<int:pk>/<slug:verb>/", views_rollouts.rollout_action, name="rollout-action"),
]
