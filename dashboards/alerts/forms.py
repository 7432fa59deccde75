"""Forms for the alert pages: a rule (its selector and labels as plain text
an operator can type) and a silence. Both are validated by the alerts app's
own rules (``controlplane.alerts.validation``), errors shown by field."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.utils import timezone

from controlplane.alerts import sources, validation
from controlplane.alerts.labels import MatcherError, coerce_matcher
from controlplane.alerts.models import AlertRule

SELECTOR_FIELDS = ("pool", "cohort", "worker")


def parse_pairs(text: str, field: str) -> dict[str, str]:
    """``zone=a, gpu=h200`` (or one per line) → {"zone": "a", "gpu": "h200"}."""
    pairs: dict[str, str] = {}
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise forms.ValidationError(f"`{part}`: write name=value.", code=field)
        name, value = part.split("=", 1)
        pairs[name.strip()] = value.strip().strip('"')
    return pairs


def format_pairs(pairs: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (pairs or {}).items())


class AlertRuleForm(forms.ModelForm):
    pool = forms.CharField(required=False, help_text="only this pool")
    cohort = forms.ChoiceField(
        required=False,
        choices=[("", "any"), ("canary", "canary"), ("baseline", "baseline"), ("stable", "stable")],
        help_text="only pools with this role in their routing table",
    )
    worker = forms.CharField(required=False, help_text="only this worker")
    worker_labels = forms.CharField(required=False, help_text="only workers with these labels, e.g. zone=a, gpu=h200")
    runbook_url = forms.URLField(required=False, max_length=500, assume_scheme="https")
    extra_labels = forms.CharField(
        required=False, label="Labels", help_text="added to every alert of the rule, e.g. team=serving"
    )

    field_order = [
        "name",
        "enabled",
        "figure",
        "pool",
        "cohort",
        "worker",
        "worker_labels",
        "group_by",
        "window_seconds",
        "compare_to",
        "comparator",
        "threshold",
        "floor",
        "min_requests_per_second",
        "for_seconds",
        "keep_firing_for_seconds",
        "no_data_state",
        "severity",
        "action",
        "extra_labels",
        "summary",
        "description",
        "runbook_url",
        "dashboard_url",
    ]

    class Meta:
        model = AlertRule
        fields = [
            "name",
            "enabled",
            "figure",
            "group_by",
            "window_seconds",
            "compare_to",
            "comparator",
            "threshold",
            "floor",
            "min_requests_per_second",
            "for_seconds",
            "keep_firing_for_seconds",
            "no_data_state",
            "severity",
            "action",
            "summary",
            "description",
            "runbook_url",
            "dashboard_url",
        ]
        widgets = {"description": forms.Textarea(attrs={"rows": 3})}
        help_texts = {
            "window_seconds": "seconds the figure looks back over",
            "threshold": "the condition holds when the value compares true with this",
            "summary": "may use {{ $value }} and {{ $labels.worker }}",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["figure"] = forms.ChoiceField(
            choices=[
                (name, f"{name} — {(sources.figure_info(name) or {}).get('label', name)}")
                for name in sources.figure_names()
            ],
            help_text="a figure of the metrics registry, or one from the fleet",
        )
        rule = self.instance
        selector = rule.selector if isinstance(rule.selector, dict) else {}
        for key in SELECTOR_FIELDS:
            self.initial.setdefault(key, selector.get(key, ""))
        self.initial.setdefault("worker_labels", format_pairs(selector.get("labels")))
        self.initial.setdefault("extra_labels", format_pairs(rule.labels))

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        selector: dict[str, Any] = {k: data[k] for k in SELECTOR_FIELDS if data.get(k)}
        try:
            worker_labels = parse_pairs(data.get("worker_labels", ""), "worker_labels")
            if worker_labels:
                selector["labels"] = worker_labels
        except forms.ValidationError as exc:
            self.add_error("worker_labels", exc)
        try:
            self.instance.labels = parse_pairs(data.get("extra_labels", ""), "extra_labels")
        except forms.ValidationError as exc:
            self.add_error("extra_labels", exc)
        self.instance.selector = selector
        for name in self.Meta.fields:
            if name in data:
                setattr(self.instance, name, data[name])
        name = str(data.get("name") or "")
        if name and AlertRule.objects.exclude(pk=self.instance.pk).filter(name=name).exists():
            self.add_error("name", "another rule has this name.")
        if not self.errors:
            for field, messages in validation.rule_errors(self.instance).items():
                target = {"selector": "pool", "labels": "extra_labels"}.get(field, field)
                if field == "selector":
                    target = next((k for k in (*SELECTOR_FIELDS, "worker_labels") if data.get(k)), "pool")
                for message in messages:
                    self.add_error(target if target in self.fields else None, message)
        return data

    def _post_clean(self) -> None:
        # clean() set the instance's fields and put rule_errors beside the
        # form's fields; the model's own clean() would raise the same errors
        # again under model names (selector, labels) the form does not have.
        pass


class SilenceForm(forms.Form):
    matchers = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text='one per line: alertname="WorkerMissing", pool=~"gpu-.*", worker!="w1"',
    )
    duration_hours = forms.FloatField(initial=2.0, min_value=0.01, label="for (hours)")
    comment = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2}),
        required=False,
        help_text="why: a silence without a reason is a mystery at 3 a.m.",
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        lines = [line.strip() for line in data.get("matchers", "").splitlines() if line.strip()]
        parsed = []
        for line in lines:
            try:
                parsed.append(coerce_matcher(line).as_api())
            except MatcherError as exc:
                self.add_error("matchers", str(exc))
        now = timezone.now()
        hours = data.get("duration_hours")
        if "matchers" not in self.errors and hours is not None:
            errors = validation.silence_errors(
                parsed, now, now + timedelta(hours=hours), data.get("comment", ""), now, creating=True
            )
            for field, messages in errors.items():
                for message in messages:
                    self.add_error(field if field in self.fields else "duration_hours", message)
        data["parsed_matchers"] = parsed
        data["starts_at"] = now
        data["ends_at"] = now + timedelta(hours=hours or 0)
        return data
