from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone

from controlplane.admin_readonly import ReadOnlyAdmin, ReadOnlyInline
from controlplane.rollouts.models import (
    AnalysisRun,
    AnalysisTemplate,
    Measurement,
    Rollout,
    RolloutEvent,
)


@admin.register(AnalysisTemplate)
class AnalysisTemplateAdmin(admin.ModelAdmin):
    # The model's clean() checks the metrics list, as the API does; runs
    # snapshot the template, so an edit never changes a running analysis.
    list_display = ["name", "interval_seconds", "count", "failure_limit", "inconclusive_limit", "updated"]
    search_fields = ["name", "description"]
    readonly_fields = ["created", "updated"]

    def save_model(self, request: HttpRequest, obj: AnalysisTemplate, form: Any, change: bool) -> None:
        obj.updated = timezone.now()
        super().save_model(request, obj, form, change)


class EventInline(ReadOnlyInline):
    model = RolloutEvent
    fields = ("time", "kind", "phase", "step_index", "actor", "message")


@admin.register(Rollout)
class RolloutAdmin(ReadOnlyAdmin):
    # Rollouts are started and steered through the API or the UI: buttons set
    # flags and the reconciler acts, auditing each move. Editing the phase or
    # weights here would race it, so the admin only shows them.
    list_display = [
        "id",
        "routing_table",
        "stable_pool",
        "canary_pool",
        "target_revision",
        "phase",
        "step_index",
        "attempt",
        "gate_status",
        "created",
        "finished_at",
    ]
    list_filter = ["phase", "gate_status", "fast_track"]
    search_fields = ["stable_pool__name", "canary_pool__name", "routing_table__model", "message"]
    list_select_related = ["routing_table", "stable_pool", "canary_pool", "target_revision__profile"]
    date_hierarchy = "created"
    inlines = [EventInline]


@admin.register(RolloutEvent)
class RolloutEventAdmin(ReadOnlyAdmin):
    list_display = ["time", "rollout", "kind", "phase", "step_index", "actor", "message"]
    list_filter = ["kind", "phase"]
    search_fields = ["message", "actor", "=rollout__id"]
    list_select_related = ["rollout__stable_pool", "rollout__target_revision__profile"]
    raw_id_fields = ["rollout"]
    show_full_result_count = False


class MeasurementInline(ReadOnlyInline):
    model = Measurement
    fields = ("taken_at", "window_seconds", "phase", "verdicts", "weights")


@admin.register(AnalysisRun)
class AnalysisRunAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "rollout", "attempt", "step_index", "phase", "started_at", "finished_at", "terminated"]
    list_filter = ["phase", "terminated"]
    search_fields = ["template_name", "canary_pool_name", "=rollout__id"]
    list_select_related = ["rollout__stable_pool", "rollout__target_revision__profile"]
    raw_id_fields = ["rollout"]
    inlines = [MeasurementInline]


@admin.register(Measurement)
class MeasurementAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "run", "taken_at", "window_seconds", "phase"]
    list_filter = ["phase"]
    list_select_related = ["run"]
    raw_id_fields = ["run"]
    show_full_result_count = False
