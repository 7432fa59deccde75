"""The audit log: one row per state change, by a person or by the system.

Rows are written through ``controlplane.audit.record()`` and never changed
afterwards. The actor is kept twice: as a foreign key (for filtering) and as a
string (so the row still says who it was after the user is deleted, and so
automatic actors such as ``system:health-sweep`` or ``worker:gpu-3`` need no
user).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone


class AuditEvent(models.Model):
    time = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_repr = models.CharField(max_length=150, help_text="username, or system:<what> / worker:<name>")
    # dotted verb, "<object>.<verb>": pool.create, profile.update, worker.drain,
    # worker.state_change, ...
    action = models.CharField(max_length=64, db_index=True)
    object_type = models.CharField(max_length=64, help_text="app_label.model, e.g. fleet.pool")
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)

    class Meta:
        ordering = ["-time", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id", "-time"], name="audit_object_time")]

    def __str__(self) -> str:
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.actor_repr} {self.action} {self.object_repr}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise ValueError("audit events are immutable; write a new one")
        super().save(*args, **kwargs)
