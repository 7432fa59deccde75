from rest_framework.routers import SimpleRouter

from controlplane.rollouts.api import AnalysisTemplateViewSet, RolloutViewSet

router = SimpleRouter()
router.register("rollouts", RolloutViewSet, basename="rollout")
router.register("analysis-templates", AnalysisTemplateViewSet, basename="analysis-template")
urlpatterns = router.urls
