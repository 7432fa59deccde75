"""The Advisor pages; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.advisor import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("advisor/", views.advisor, name="advisor"),
    path("advisor/<slug:scope>/", views.report, name="advisor-report"),
]
