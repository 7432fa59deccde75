"""The alert pages; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards import views_alerts

urlpatterns: list[URLPattern | URLResolver] = [
    path("alerts/", views_alerts.alerts, name="alerts"),
    path("alerts/banner/", views_alerts.banner, name="alerts-banner"),
    path("alerts/<int:pk>/", views_alerts.alert_detail, name="alert-detail"),
    path("alerts/rules/", views_alerts.rules, name="alert-rules"),
    path("alerts/rules/new/", views_alerts.rule_edit, name="alert-rule-new"),
    path("alerts/rules/test/", views_alerts.rule_test, name="alert-rule-test"),
    path("alerts/rules/<int:pk>/", views_alerts.rule_edit, name="alert-rule-edit"),
    path("alerts/rules/<int:pk>/toggle/", views_alerts.rule_toggle, name="alert-rule-toggle"),
    path("alerts/silences/", views_alerts.silences, name="alert-silences"),
    path("alerts/silences/<int:pk>/expire/", views_alerts.silence_expire, name="alert-silence-expire"),
]
