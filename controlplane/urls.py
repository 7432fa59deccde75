from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.metrics.api import PrometheusView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/", include("controlplane.api_urls")),
    # Pages without the base template (admin, API docs) get the same icon, not a 404.
    path("favicon.ico", RedirectView.as_view(url=static("dashboards/favicon.svg"), permanent=True)),
    # The control plane's own Prometheus exposition: for scrapers, not a page.
    re_path(r"^metrics/?$", PrometheusView.as_view(), name="prometheus-metrics"),
    path("", include("dashboards.urls")),
]

# A store outage raised outside a view is a 503 too (controlplane/outages.py).
handler500 = "controlplane.outages.server_error"
