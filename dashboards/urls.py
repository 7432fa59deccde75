from django.contrib.auth import views as auth_views
from django.urls import URLPattern, URLResolver, include, path

from dashboards import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("login/", auth_views.LoginView.as_view(template_name="dashboards/login.html", redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.fleet, name="fleet"),
    path("workers/<int:pk>/", views.worker_detail, name="worker-detail"),
    path("workers/<int:pk>/<slug:verb>/", views.worker_action, name="worker-action"),
    path("profiles/", views.profiles, name="profiles"),
    path("profiles/new/", views.profile_edit, name="profile-new"),
    path("profiles/<int:pk>/", views.profile_detail, name="profile-detail"),
    path("profiles/<int:pk>/edit/", views.profile_edit, name="profile-edit"),
    path("audit/", views.audit_log, name="audit-log"),
    path("", include("dashboards.urls_metrics")),
    path("", include("dashboards.urls_rollouts")),
    path("", include("dashboards.urls_alerts")),
]
