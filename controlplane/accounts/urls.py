from django.urls import URLPattern, URLResolver, path

from controlplane.accounts.api import MeView

urlpatterns: list[URLPattern | URLResolver] = [path("me/", MeView.as_view(), name="me")]
