from django.urls import URLPattern, URLResolver, path

from controlplane.accounts.inputs import ApiRouter
from controlplane.alerts.api import (
    AlertRuleViewSet,
    AlertViewSet,
    InboundWebhookView,
    ReceiverViewSet,
    RouteViewSet,
    SilenceViewSet,
)

router = ApiRouter()
router.register("alerts", AlertViewSet, basename="alert")
router.register("alert-rules", AlertRuleViewSet, basename="alert-rule")
router.register("silences", SilenceViewSet, basename="silence")
router.register("alert-receivers", ReceiverViewSet, basename="alert-receiver")
router.register("alert-routes", RouteViewSet, basename="alert-route")

urlpatterns: list[URLPattern | URLResolver] = [
    # Before the router, whose alerts/<pk>/ would otherwise take "webhook".
    path("alerts/webhook/", InboundWebhookView.as_view(), name="alerts-webhook"),
    *router.urls,
]
