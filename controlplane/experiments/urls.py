from controlplane.accounts.inputs import ApiRouter
from controlplane.experiments.api import ExperimentViewSet, WorkloadViewSet

router = ApiRouter()
router.register("workloads", WorkloadViewSet, basename="workload")
router.register("experiments", ExperimentViewSet, basename="experiment")
urlpatterns = router.urls
