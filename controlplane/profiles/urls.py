from controlplane.accounts.inputs import ApiRouter
from controlplane.profiles.api import ProfileRevisionViewSet, ProfileViewSet

router = ApiRouter()
router.register("profiles", ProfileViewSet, basename="profile")
router.register("profile-revisions", ProfileRevisionViewSet, basename="profile-revision")
urlpatterns = router.urls
