from rest_framework.routers import SimpleRouter

from controlplane.audit.api import AuditEventViewSet

router = SimpleRouter()
router.register("audit", AuditEventViewSet, basename="audit")
urlpatterns = router.urls
