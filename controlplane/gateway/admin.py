from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from controlplane.admin_readonly import ReadOnlyAdmin
from controlplane.fleet.pools import ROLES
from controlplane.gateway.models import ClientKey, RequestLog, RoutingPool, RoutingTable


class RoutingPoolInline(admin.TabularInline):
    model = RoutingPool
    fields = ("role", "pool", "weight_bp")
    readonly_fields = ("role", "pool", "weight_bp")
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(RoutingTable)
class RoutingTableAdmin(ReadOnlyAdmin):
    # Weights change through the API, the UI or a rollout: they validate,
    # audit and bump the epoch every gateway must ack. A save here would do
    # none of that, so the admin only shows tables.
    list_display = ["model", "epoch", "max_output_tokens", "updated_at"]
    search_fields = ["model"]
    readonly_fields = ["model", "salt", "epoch", "max_output_tokens", "updated_at"]
    inlines = [RoutingPoolInline]


@admin.register(RoutingPool)
class RoutingPoolAdmin(ReadOnlyAdmin):
    list_display = ["table", "role", "pool", "weight_bp"]
    list_filter = ["role", "table"]
    search_fields = ["table__model", "pool__name"]
    list_select_related = ["table", "pool"]


@admin.register(ClientKey)
class ClientKeyAdmin(admin.ModelAdmin):
    # Keys are issued through the API (the plaintext is shown once); here
    # they can be renamed, promoted and deactivated.
    list_display = ["name", "key_prefix", "is_admin", "max_output_tokens", "active", "last_used", "created"]
    list_filter = ["active", "is_admin"]
    search_fields = ["name", "key_prefix"]
    readonly_fields = ["key_prefix", "created", "created_by", "last_used"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        obj.announce()  # gateways reload their key set, as after an API change


class CohortFilter(admin.SimpleListFilter):
    # The known roles, so the filter never asks the table for its values.
    title = "cohort"
    parameter_name = "cohort"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(role, role) for role in ROLES]

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        return queryset.filter(cohort=self.value()) if self.value() else queryset


@admin.register(RequestLog)
class RequestLogAdmin(admin.ModelAdmin):
    # Millions of rows written by gateways: read-only, no full count, no
    # date hierarchy or filter whose choices would need a scan.
    list_display = [
        "created_at",
        "request_id",
        "model",
        "cohort",
        "pool",
        "worker",
        "status",
        "ttft_seconds",
        "e2e_seconds",
        "output_tokens",
    ]
    list_filter = [CohortFilter, "stream"]
    search_fields = ["=request_id"]
    list_select_related = ["pool", "worker"]
    show_full_result_count = False
    raw_id_fields = ["pool", "worker", "profile_revision", "api_key"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
