"""ASGI entry point: HTTP through Django, websockets through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from controlplane import embedded  # noqa: E402  (needs settings)

embedded.lease_if_embedded()  # the web app uses Redis (channel layer, bus, Celery): hold it up while it runs

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs apps loaded)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from controlplane.fleet.heartbeat import HeartbeatFastPath  # noqa: E402
from dashboards.live import OutageGuard  # noqa: E402
from dashboards.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Heartbeats skip Django's request stack (see controlplane/fleet/heartbeat.py).
        # Django's stubs type the ASGI scope as a plain dict, hence the ignore.
        "http": HeartbeatFastPath(django_asgi_app),  # type: ignore[arg-type]
        # A store outage closes a socket cleanly, with a reason (dashboards/live.py).
        "websocket": OutageGuard(AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
    }
)
