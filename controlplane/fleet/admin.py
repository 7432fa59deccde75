from django.contrib import admin
from django.db import models

from controlplane.fleet.models import EnrollmentToken, Pool, Worker


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ["name", "desired_revision", "created"]
    search_fields = ["name"]
    autocomplete_fields = ["desired_revision"]


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    # Workers listen on plain http inside the cluster; a URL typed without a
    # scheme means that (Django 6 would assume https).
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}
    list_display = [
        "name",
        "pool",
        "state",
        "engine_kind",
        "running_revision",
        "desired_revision",
        "cordoned",
        "drain_requested",
        "last_heartbeat_at",
        "drift_since",
    ]
    list_filter = ["state", "pool", "engine_kind", "cordoned", "drain_requested"]
    search_fields = ["name", "url", "model"]
    readonly_fields = [
        "state_changed_at",
        "last_heartbeat_at",
        "load",
        "hardware",
        "running_profile",
        "apply_error",
        "drift_since",
        "registered_at",
        "enrollment_token",
    ]
    autocomplete_fields = ["desired_revision", "running_revision"]


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(admin.ModelAdmin):
    # Tokens are issued through the API or `manage.py demo` (the plaintext is
    # shown once); here they can be read, limited and revoked.
    list_display = ["name", "token_prefix", "pool", "num_uses", "max_uses", "expires_at", "created"]
    readonly_fields = ["token_prefix", "num_uses", "created_by", "created"]

    def has_add_permission(self, request):
        return False
