from django.urls import path

from controlplane.accounts.inputs import ApiRouter
from controlplane.fleet.api import (
    AgentHeartbeatView,
    AgentRegisterView,
    EnrollmentTokenViewSet,
    PoolViewSet,
    WorkerViewSet,
)

router = ApiRouter()
router.register("pools", PoolViewSet, basename="pool")
router.register("workers", WorkerViewSet, basename="worker")
router.register("enrollment-tokens", EnrollmentTokenViewSet, basename="enrollment-token")

# The paths the agent contract names (workers/contract.py).
urlpatterns = [
    path("agent/register/", AgentRegisterView.as_view(), name="agent-register"),
    path("agent/heartbeat/", AgentHeartbeatView.as_view(), name="agent-heartbeat"),
    *router.urls,
]
