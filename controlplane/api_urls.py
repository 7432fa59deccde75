"""Everything under /api/v1/: each domain app contributes its own urls.py."""

from django.urls import include, path

urlpatterns = [
    path("", include("controlplane.accounts.urls")),
    path("", include("controlplane.audit.urls")),
    path("", include("controlplane.fleet.urls")),
    path("", include("controlplane.profiles.urls")),
    path("", include("controlplane.gateway.urls")),
    path("", include("controlplane.metrics.urls")),
    path("", include("controlplane.rollouts.urls")),
    path("", include("controlplane.alerts.urls")),
    path("", include("controlplane.experiments.urls")),
    path("", include("controlplane.advisor.urls")),
]
