from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db import models
from django.http import HttpRequest
from django.utils import timezone

from controlplane.admin_readonly import ReadOnlyAdmin
from controlplane.alerts import validation
from controlplane.alerts.models import (
    Alert,
    AlertRule,
    AlertTransition,
    Delivery,
    InboundAlert,
    NotificationGroup,
    Receiver,
    Route,
    Silence,
)

# Runbooks and webhooks are typed with their scheme; one typed without
# means https (Django 6's default, said now so it does not warn).
URL_OVERRIDES: dict[type[models.Field[Any, Any]], dict[str, Any]] = {models.URLField: {"assume_scheme": "https"}}


@admin.register(AlertRule)
class AlertRuleAdmin(admin.ModelAdmin):
    # The model's clean() gives the API's field errors, so the form checks the same.
    formfield_overrides = URL_OVERRIDES
    list_display = [
        "name",
        "enabled",
        "figure",
        "group_by",
        "comparator",
        "threshold",
        "for_seconds",
        "severity",
        "action",
        "last_evaluated_at",
    ]
    list_filter = ["enabled", "severity", "action", "group_by"]
    search_fields = ["name", "key", "figure", "summary"]
    readonly_fields = ["created_at", "updated_at", "last_evaluated_at", "last_error"]

    def save_model(self, request: HttpRequest, obj: AlertRule, form: Any, change: bool) -> None:
        obj.updated_at = timezone.now()
        super().save_model(request, obj, form, change)


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    list_display = [
        "__str__",
        "rule",
        "source",
        "state",
        "value",
        "fired_at",
        "resolved_at",
        "flapping",
        "state_changed_at",
    ]
    list_filter = ["state", "source", "flapping"]
    search_fields = ["=fingerprint", "rule__name"]
    list_select_related = ["rule"]
    show_full_result_count = False


@admin.register(AlertTransition)
class AlertTransitionAdmin(ReadOnlyAdmin):
    list_display = ["at", "fingerprint", "rule", "from_state", "to_state", "value", "reason"]
    list_filter = ["to_state"]
    search_fields = ["=fingerprint", "rule__name"]
    list_select_related = ["rule"]
    raw_id_fields = ["alert", "rule"]
    show_full_result_count = False


def _https_by_default(db_field: models.Field, **kwargs: Any) -> Any:
    if isinstance(db_field, models.URLField):
        kwargs.setdefault("assume_scheme", "https")
    return db_field.formfield(**kwargs)


def _add_errors(form: forms.ModelForm[Any], errors: dict[str, list[str]]) -> None:
    """The API's field-level validation errors, shown on the admin form."""
    for field, messages in errors.items():
        for message in messages:
            form.add_error(field, message)


class ReceiverForm(forms.ModelForm):
    class Meta:
        model = Receiver
        fields = "__all__"
        formfield_callback = _https_by_default  # the admin's own callback replaces it
        # Never echo a stored token into the page; an empty field keeps it.
        widgets = {"bearer_token": forms.PasswordInput(render_value=False)}

    def clean_bearer_token(self) -> str:
        token = self.cleaned_data.get("bearer_token") or ""
        return token or (self.instance.bearer_token if self.instance.pk else "")

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        errors = validation.receiver_errors(
            str(data.get("kind") or ""), str(data.get("url") or ""), data.get("emails", [])
        )
        _add_errors(self, errors)
        return data


@admin.register(Receiver)
class ReceiverAdmin(admin.ModelAdmin):
    form = ReceiverForm
    formfield_overrides = URL_OVERRIDES
    list_display = ["name", "kind", "url", "enabled", "is_default", "send_resolved", "last_forwarded_at"]
    list_filter = ["kind", "enabled", "is_default"]
    search_fields = ["name", "url"]
    readonly_fields = ["last_forwarded_at", "created_at"]


class RouteForm(forms.ModelForm):
    class Meta:
        model = Route
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        timings = {f: data.get(f) for f in ("group_wait_seconds", "group_interval_seconds", "repeat_interval_seconds")}
        errors = validation.route_errors(data.get("matchers", []), data.get("group_by", []), timings)
        receiver = data.get("receiver")
        if receiver is not None and receiver.kind == Receiver.KIND_ALERTMANAGER:
            errors.setdefault("receiver", []).append(
                "an external Alertmanager gets every alert unrouted; route to webhook or email receivers."
            )
        _add_errors(self, errors)
        return data


@admin.register(Route)
class RouteAdmin(admin.ModelAdmin):
    form = RouteForm
    list_display = ["__str__", "position", "receiver", "continue_matching"]
    list_filter = ["receiver"]
    list_select_related = ["receiver"]


@admin.register(NotificationGroup)
class NotificationGroupAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "receiver", "next_flush_at", "last_notified_at"]
    list_filter = ["receiver"]
    search_fields = ["group_key"]
    list_select_related = ["receiver"]
    raw_id_fields = ["receiver", "in_flight"]


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "receiver", "reason", "status", "num_attempts", "sent_at", "last_error"]
    list_filter = ["status", "receiver"]
    list_select_related = ["receiver"]
    raw_id_fields = ["receiver", "group"]
    show_full_result_count = False


@admin.register(Silence)
class SilenceAdmin(ReadOnlyAdmin):
    # Silences are made and expired through the API or the UI, which check
    # the matchers, record the author and audit each change.
    list_display = ["__str__", "created_by", "starts_at", "ends_at", "comment"]
    search_fields = ["created_by", "comment"]
    date_hierarchy = "starts_at"


@admin.register(InboundAlert)
class InboundAlertAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "status", "receiver", "received_at", "outcome", "ends_at"]
    list_filter = ["status"]
    search_fields = ["=fingerprint", "receiver", "outcome"]
