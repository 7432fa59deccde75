from rest_framework.routers import SimpleRouter

from controlplane.profiles.api import ProfileRevisionViewSet, ProfileViewSet

router = SimpleRouter()
router.register("profiles", ProfileViewSet, basename="profile")
router.register("profile-revisions", ProfileRevisionViewSet, basename="profile-revision")
urlpatterns = router.urls
