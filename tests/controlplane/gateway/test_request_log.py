"""The request log: batched writes off the request path, and retention."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.gateway.log_writer import LogWriter, write_records
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.models import RequestLog
from controlplane.gateway.record import RequestRecord
from controlplane.gateway.tasks import purge_request_log
from tests.controlplane.gateway.factories import routed_model


def record(**fields: Any) -> RequestRecord:
    base: dict[str, Any] = {
        "request_id": "r",
        "created_at": time.time(),
        "model": "tiny",
        "cohort": "stable",
        "status": 200,
        "stream": True,
        "ttft_seconds": 0.05,
        "e2e_seconds": 0.5,
    }
    return RequestRecord(**{**base, **fields})


def test_the_writer_batches_rows_into_the_log_and_marks_keys_used(transactional_db: Any) -> None:
    from controlplane.gateway.models import ClientKey

    table, pools, workers = routed_model()
    key, _ = ClientKey.issue("app")
    worker = workers["stable"][0]
    writer = LogWriter(flush_seconds=0.05, batch_size=100, max_backlog=1000)
    writer.start()
    for i in range(250):
        writer.put(record(request_id=f"r{i}", pool_id=pools["stable"].pk, worker_id=worker.pk, api_key_id=key.pk))
    writer.stop()
    assert RequestLog.objects.count() == 250 and writer.num_written == 250
    row = RequestLog.objects.get(request_id="r7")
    assert (row.pool, row.worker, row.api_key, row.cohort) == (pools["stable"], worker, key, "stable")
    key.refresh_from_db()
    assert key.last_used is not None


def test_rows_that_name_a_deleted_worker_are_kept_without_it(transactional_db: Any) -> None:
    _, pools, workers = routed_model()
    write_records(
        [
            record(request_id="gone", pool_id=pools["stable"].pk, worker_id=999_999, profile_revision_id=888_888),
            record(request_id="fine", pool_id=pools["stable"].pk, worker_id=workers["stable"][0].pk),
        ]
    )
    gone, fine = RequestLog.objects.get(request_id="gone"), RequestLog.objects.get(request_id="fine")
    assert (gone.worker_id, gone.profile_revision_id, gone.pool_id) == (None, None, pools["stable"].pk)
    assert fine.worker_id == workers["stable"][0].pk


def test_a_backlog_past_its_bound_drops_the_oldest_rows_and_counts_them() -> None:
    metrics = GatewayMetrics()
    writer = LogWriter(flush_seconds=60, batch_size=10_000, max_backlog=3, metrics=metrics)
    for i in range(5):
        writer.put(record(request_id=str(i)))
    assert [r.request_id for r in writer._rows] == ["2", "3", "4"]
    assert b"chunkpilot:gateway_request_log_dropped_total 2.0" in metrics.render()


@pytest.mark.django_db
def test_rows_past_retention_are_purged_by_the_beat_task(settings: Any) -> None:
    settings.GATEWAY_LOG_RETENTION_DAYS = 2
    now = timezone.now()
    for age_days in (0, 1, 1.9, 2.1, 5, 30):
        RequestLog.objects.create(
            request_id=f"{age_days}", created_at=now - timedelta(days=age_days), model="tiny", status=200
        )
    assert purge_request_log() == 3
    assert sorted(RequestLog.objects.values_list("request_id", flat=True)) == ["0", "1", "1.9"]
    assert purge_request_log() == 0


def test_the_retention_task_is_on_beats_schedule() -> None:
    from controlplane.celery import app

    app.loader.import_default_modules()
    app.finalize()
    schedule = app.conf.beat_schedule
    assert schedule["gateway request-log retention"]["task"] == "gateway.purge_request_log"


def test_text_postgresql_cannot_hold_is_written_with_replacements_not_left_to_stall_the_log(
    transactional_db: Any,
) -> None:
    """A worker's error message may quote a request's text: a lone surrogate
    or a NUL in it failed the whole batch, which was then retried forever."""
    write_records(
        [
            record(request_id="odd\x00id", status=400, error="`prompt` holds a\ud800b and a\x00 NUL"),
            record(request_id="plain", status=400, error="caf\u00e9"),
        ]
    )
    rows = {row.request_id: row.error for row in RequestLog.objects.all()}
    assert rows == {"odd\ufffdid": "`prompt` holds a?b and a\ufffd NUL", "plain": "caf\u00e9"}
