from django.urls import path

from controlplane.accounts.inputs import ApiRouter
from controlplane.gateway.api import (
    ClientKeyViewSet,
    GatewayListView,
    RequestDetailView,
    RequestExportView,
    RequestListView,
    RoutingAcksView,
    RoutingTableListView,
    RoutingTableView,
)

router = ApiRouter()
router.register("client-keys", ClientKeyViewSet, basename="client-key")

# Model names may hold slashes (org/name): <path:>, with the acks route first
# so ".../acks/" is not read as part of a model's name.
urlpatterns = [
    path("routing/", RoutingTableListView.as_view(), name="routing-list"),
    path("routing/<path:model>/acks/", RoutingAcksView.as_view(), name="routing-acks"),
    path("routing/<path:model>/", RoutingTableView.as_view(), name="routing-detail"),
    path("gateways/", GatewayListView.as_view(), name="gateway-list"),
    path("requests/", RequestListView.as_view(), name="api-request-list"),
    path("requests/export/", RequestExportView.as_view(), name="api-request-export"),
    path("requests/<int:pk>/", RequestDetailView.as_view(), name="api-request-detail"),
    *router.urls,
]
