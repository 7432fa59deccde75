"""The web UI's pages, one urls.py per domain (``dashboards/<domain>/``)."""

from django.urls import URLPattern, URLResolver, include, path

urlpatterns: list[URLPattern | URLResolver] = [
    path("", include("dashboards.accounts.urls")),
    path("", include("dashboards.fleet.urls")),
    path("", include("dashboards.profiles.urls")),
    path("", include("dashboards.audit.urls")),
    path("", include("dashboards.metrics.urls")),
    path("", include("dashboards.rollouts.urls")),
    path("", include("dashboards.alerts.urls")),
    path("", include("dashboards.experiments.urls")),
    path("", include("dashboards.advisor.urls")),
    path("", include("dashboards.requests.urls")),
]
