"""The Requests pages; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.requests import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("requests/", views.request_list, name="requests"),
    path("requests/<int:pk>/", views.request_detail, name="request-page"),
]
