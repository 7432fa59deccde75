from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.gateway.api import (
    ClientKeyViewSet,
    GatewayListView,
    RoutingAcksView,
    RoutingTableListView,
    RoutingTableView,
)

router = SimpleRouter()
router.register("client-keys", ClientKeyViewSet, basename="client-key")

# Model names may hold slashes (org/name): <path:>, with the acks route first
# so ".../acks/" is not read as part of a model's name.
urlpatterns = [
    path("routing/", RoutingTableListView.as_view(), name="routing-list"),
    path("routing/<path:model>/acks/", RoutingAcksView.as_view(), name="routing-acks"),
    path("routing/<path:model>/", RoutingTableView.as_view(), name="routing-detail"),
    path("gateways/", GatewayListView.as_view(), name="gateway-list"),
    *router.urls,
]
