"""The profile pages; included from ``dashboards/urls.py``."""

from django.urls import URLPattern, URLResolver, path

from dashboards.profiles import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("profiles/", views.profiles, name="profiles"),
    path("profiles/new/", views.profile_edit, name="profile-new"),
    path("profiles/<int:pk>/", views.profile_detail, name="profile-detail"),
    path("profiles/<int:pk>/edit/", views.profile_edit, name="profile-edit"),
]
