"""The audit log page; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.audit import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("audit/", views.audit_log, name="audit-log"),
]
