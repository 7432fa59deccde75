"""The web UI's websockets: each domain's urls.py names its own
(``websocket_urlpatterns``), one Channels consumer per live view."""

from django.urls import URLPattern

from dashboards.alerts import urls as alerts
from dashboards.experiments import urls as experiments
from dashboards.fleet import urls as fleet
from dashboards.metrics import urls as metrics
from dashboards.rollouts import urls as rollouts

websocket_urlpatterns: list[URLPattern] = [
    *fleet.websocket_urlpatterns,
    *metrics.websocket_urlpatterns,
    *rollouts.websocket_urlpatterns,
    *alerts.websocket_urlpatterns,
    *experiments.websocket_urlpatterns,
]
