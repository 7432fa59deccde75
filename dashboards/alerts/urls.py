"""The alert pages and their websockets; included from ``dashboards/urls.py``
and ``dashboards/routing.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.alerts import views
from dashboards.alerts.consumers import AlertsConsumer, BannerConsumer

urlpatterns: list[URLPattern | URLResolver] = [
    path("alerts/", views.alerts, name="alerts"),
    path("alerts/banner/", views.banner, name="alerts-banner"),
    path("alerts/<int:pk>/", views.alert_detail, name="alert-detail"),
    path("alerts/rules/", views.rules, name="alert-rules"),
    path("alerts/rules/new/", views.rule_edit, name="alert-rule-new"),
    path("alerts/rules/test/", views.rule_test, name="alert-rule-test"),
    path("alerts/rules/<int:pk>/", views.rule_edit, name="alert-rule-edit"),
    path("alerts/rules/<int:pk>/toggle/", views.rule_toggle, name="alert-rule-toggle"),
    path("alerts/silences/", views.silences, name="alert-silences"),
    path("alerts/silences/<int:pk>/expire/", views.silence_expire, name="alert-silence-expire"),
]

websocket_urlpatterns: list[URLPattern] = [
    path("ws/alerts/", AlertsConsumer.as_asgi(), name="ws-alerts"),
    path("ws/alerts/banner/", BannerConsumer.as_asgi(), name="ws-alerts-banner"),
]
