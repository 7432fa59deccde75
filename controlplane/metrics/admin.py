from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from controlplane.admin_readonly import ReadOnlyAdmin
from controlplane.metrics.models import (
    CounterReset,
    Rollup,
    ScrapeRound,
    ScrapeStatus,
    SeriesLayout,
    ServiceObjectives,
    Snapshot,
    Target,
)


class SeriesRowAdmin(ReadOnlyAdmin):
    # 864 000 snapshots a day for 50 workers: no full count, no filter or
    # date hierarchy whose choices need a scan; the packed vector stays out.
    list_select_related = ["target"]
    show_full_result_count = False
    raw_id_fields = ["target"]
    exclude = ["values"]


@admin.register(SeriesLayout)
class SeriesLayoutAdmin(ReadOnlyAdmin):
    list_display = ["id", "digest", "num_keys"]
    search_fields = ["=digest"]

    @admin.display(description="series")
    def num_keys(self, obj: SeriesLayout) -> int:
        return len(obj.keys or [])


@admin.register(Target)
class TargetAdmin(ReadOnlyAdmin):
    list_display = ["worker_name", "pool_name", "cohort", "layout", "first_at", "last_at", "num_samples", "num_rollups"]
    list_filter = ["cohort", "pool_name"]
    search_fields = ["worker_name", "pool_name"]
    list_select_related = ["layout"]
    raw_id_fields = ["worker", "layout"]
    exclude = ["last_raw", "offsets"]


@admin.register(Snapshot)
class SnapshotAdmin(SeriesRowAdmin):
    list_display = ["target", "ts", "seq", "peak_memory_bytes"]


@admin.register(Rollup)
class RollupAdmin(SeriesRowAdmin):
    list_display = ["target", "minute", "last_ts", "seq", "num_samples", "peak_memory_bytes"]


@admin.register(CounterReset)
class CounterResetAdmin(ReadOnlyAdmin):
    list_display = ["target", "ts"]
    list_select_related = ["target"]
    raw_id_fields = ["target"]
    exclude = ["offsets"]


@admin.register(ScrapeStatus)
class ScrapeStatusAdmin(ReadOnlyAdmin):
    list_display = [
        "worker",
        "up",
        "last_attempt_at",
        "last_success_at",
        "last_duration_seconds",
        "num_consecutive_failures",
        "last_error",
    ]
    list_filter = ["up"]
    search_fields = ["worker__name", "last_error"]
    list_select_related = ["worker"]


@admin.register(ScrapeRound)
class ScrapeRoundAdmin(ReadOnlyAdmin):
    list_display = ["started_at", "finished_at", "num_targets", "num_failed"]
    show_full_result_count = False


@admin.register(ServiceObjectives)
class ServiceObjectivesAdmin(admin.ModelAdmin):
    # One row, made on first read; a change is audited as through the API.
    list_display = ["__str__", "updated_at"]
    fields = ["ttft_seconds", "tpot_seconds", "updated_at"]
    readonly_fields = ["updated_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: ServiceObjectives, form: Any, change: bool) -> None:
        ServiceObjectives.objects.get(pk=obj.pk).change(obj.ttft_seconds, obj.tpot_seconds, actor=request.user)
