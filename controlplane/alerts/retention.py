"""What alerting keeps, and for how long: transitions, quiet alerts and
inbound webhook records for ALERT_HISTORY_RETENTION_DAYS (30), finished
deliveries for ALERT_DELIVERY_RETENTION_DAYS (7). Deleted in short batches;
safe to run twice at once."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Model, QuerySet

from controlplane.alerts import conf
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, AlertTransition, Delivery, InboundAlert

BATCH_SIZE = 5000


def _delete_in_batches(qs: QuerySet[Model]) -> int:
    deleted = 0
    while True:
        ids = list(qs.values_list("pk", flat=True)[:BATCH_SIZE])
        if not ids:
            return deleted
        deleted += qs.model._default_manager.filter(pk__in=ids).delete()[1].get(qs.model._meta.label, 0)


def purge(now: datetime) -> dict[str, int]:
    history = now - timedelta(days=conf.ALERT_HISTORY_RETENTION_DAYS.get())
    deliveries = now - timedelta(days=conf.ALERT_DELIVERY_RETENTION_DAYS.get())
    return {
        "transitions": _delete_in_batches(AlertTransition.objects.filter(at__lt=history)),
        # Alerts quiet since before the horizon (their remaining transitions go with them).
        "alerts": _delete_in_batches(
            Alert.objects.filter(
                state__lte=AlertState.RESOLVED,
                state_changed_at__lt=history,
                nodata_since__isnull=True,
                keep_firing_since__isnull=True,
            )
        ),
        "deliveries": _delete_in_batches(
            Delivery.objects.filter(status__in=[Delivery.SENT, Delivery.FAILED], created_at__lt=deliveries)
        ),
        "inbound": _delete_in_batches(InboundAlert.objects.filter(received_at__lt=history)),
    }
