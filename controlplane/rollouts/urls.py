from controlplane.accounts.inputs import ApiRouter
from controlplane.rollouts.api import AnalysisTemplateViewSet, RolloutViewSet

router = ApiRouter()
router.register("rollouts", RolloutViewSet, basename="rollout")
router.register("analysis-templates", AnalysisTemplateViewSet, basename="analysis-template")
urlpatterns = router.urls
