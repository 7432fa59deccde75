from django.urls import URLPattern, URLResolver, re_path

from controlplane.advisor.api import ReportsView, ReportView

urlpatterns: list[URLPattern | URLResolver] = [
    re_path(r"^advisor/reports/?$", ReportsView.as_view(), name="advisor-reports"),
    re_path(r"^advisor/reports/(?P<scope>[-a-zA-Z0-9_]+)/?$", ReportView.as_view(), name="advisor-report"),
]
