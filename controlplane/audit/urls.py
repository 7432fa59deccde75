from controlplane.accounts.inputs import ApiRouter
from controlplane.audit.api import AuditEventViewSet

router = ApiRouter()
router.register("audit", AuditEventViewSet, basename="audit")
urlpatterns = router.urls
