from __future__ import annotations

from django.contrib import admin

from controlplane.admin_readonly import ReadOnlyAdmin, ReadOnlyInline
from controlplane.experiments.models import Arm, Experiment, Workload


@admin.register(Workload)
class WorkloadAdmin(ReadOnlyAdmin):
    # Captured from the request log or a scenario, then immutable: an
    # experiment's results name the version they replayed.
    list_display = ["name", "version", "source", "num_requests", "created"]
    list_filter = ["source"]
    search_fields = ["name"]


class ArmInline(ReadOnlyInline):
    model = Arm
    fields = ("index", "name", "status", "attempts", "error", "started_at", "finished_at")


@admin.register(Experiment)
class ExperimentAdmin(ReadOnlyAdmin):
    # The runner owns the phase and the arms; the admin only shows them.
    list_display = ["id", "name", "workload", "phase", "repeats", "duration_seconds", "created", "finished_at"]
    list_filter = ["phase"]
    search_fields = ["name"]
    inlines = [ArmInline]


@admin.register(Arm)
class ArmAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "experiment", "index", "name", "status", "attempts"]
    list_filter = ["status"]
    raw_id_fields = ["experiment"]
