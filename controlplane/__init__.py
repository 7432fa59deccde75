"""The Chunkpilot control plane (Django project and its domain apps)."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
