"""The Celery app. Each domain app registers its periodic tasks in its own
``tasks.py`` (``@app.on_after_finalize.connect``), so beat's schedule is the
union of the apps that are installed."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("chunkpilot")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
