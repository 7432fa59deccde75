"""The "New experiment" form. ``Experiment.create`` judges the whole; its
errors are shown by field (an arm's as the form's own, naming the arm)."""

from __future__ import annotations

from typing import Any

from django import forms

from controlplane.experiments.models import DEFAULT_CHUNK_SIZES, DEFAULT_OBJECTIVES, Mode, Workload, arm_profile_ids
from controlplane.experiments.recommend import DEFAULT_REPEATS
from controlplane.fleet.models import Worker
from controlplane.profiles.models import ProfileRevision
from workers import loadgen

CAPTURE = "capture"  # the workload choice that captures the last minutes of the request log
SCENARIO = "scenario"


class ExperimentForm(forms.Form):
    name = forms.CharField(max_length=100, initial="chunk-size sweep")
    mode = forms.ChoiceField(
        choices=Mode.choices,
        initial=Mode.MEASURE,
        required=False,
        help_text="predict: every arm in virtual time on the simulated device of the workers' own GPU and model "
        "(seconds, the workers stay in traffic), repeated until the intervals are narrow; then verify the best on "
        "the lab workers",
    )
    workload = forms.ChoiceField(help_text="a stored workload, or a new one taken now")
    capture_minutes = forms.FloatField(
        initial=15, min_value=0.1, required=False, help_text="for a new capture: the request log's last minutes"
    )
    scenario = forms.ChoiceField(
        choices=[(s, s) for s in loadgen.SCENARIOS],
        initial="long-tail",
        required=False,
        help_text="for a new loadgen workload",
    )
    scenario_rate = forms.FloatField(initial=1.0, min_value=0.01, required=False, label="Scenario rate (req/s)")
    workers = forms.ModelMultipleChoiceField(
        queryset=Worker.objects.order_by("name"),
        to_field_name="name",
        help_text="taken out of traffic (cordoned) while it runs",
    )
    chunk_sizes = forms.CharField(
        initial=", ".join(str(c) for c in DEFAULT_CHUNK_SIZES),
        help_text="long_prefill_token_threshold of each chunked arm; each keeps the baseline's other knobs",
    )
    baseline_revision = forms.ModelChoiceField(
        queryset=ProfileRevision.objects.exclude(profile__in=arm_profile_ids())
        .select_related("profile")
        .order_by("profile__name", "-revision"),
        required=False,
        empty_label="the profile the workers run now",
        help_text="the baseline every arm is set beside (a monolithic arm runs beside a chunked one)",
    )
    budgets = forms.CharField(
        required=False,
        help_text="max_num_batched_tokens values to grid over; empty: each "
        "arm's chunk size (at least the default budget)",
    )
    short_prompt_thresholds = forms.CharField(required=False, help_text="short_prompt_threshold values to grid over")
    duration_seconds = forms.FloatField(initial=20, min_value=1, help_text="measured replay per arm and repeat")
    warmup_seconds = forms.FloatField(initial=5, min_value=0)
    repeats = forms.IntegerField(
        initial=DEFAULT_REPEATS,
        min_value=1,
        max_value=20,
        help_text="paired: repeat r of every arm replays the same requests; one repeat names no winner",
    )
    rate_scale = forms.FloatField(
        initial=1.0, min_value=0.001, help_text="replay at this multiple of the recorded rate"
    )
    capacity_rate_scales = forms.CharField(
        required=False,
        label="Capacity ramp (rate multiples)",
        help_text="optional, e.g. 1, 2, 4, 8: after its repeats each arm replays at these rising multiples of the "
        "rate, up to the first at which fewer than 90% of the requests meet both objectives; its serving "
        "capacity is the highest that held",
    )
    capacity_seconds = forms.FloatField(initial=20, min_value=1, required=False, help_text="replay per ramp point")
    ttft_ms = forms.FloatField(initial=DEFAULT_OBJECTIVES["ttft_ms"], min_value=1, label="TTFT P99 objective (ms)")
    tpot_ms = forms.FloatField(initial=DEFAULT_OBJECTIVES["tpot_ms"], min_value=1, label="TPOT P99 objective (ms)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stored = [
            (str(w.pk), f"{w} ({w.num_requests} requests, {w.get_source_display()})")
            for w in Workload.objects.order_by("-created")[:50]
        ]
        workload = self.fields["workload"]
        assert isinstance(workload, forms.ChoiceField)
        workload.choices = [(CAPTURE, "capture the request log now"), (SCENARIO, "a loadgen scenario"), *stored]

    @staticmethod
    def _ints(value: str, field: str) -> tuple[int, ...]:
        try:
            numbers = tuple(int(v) for v in value.replace(",", " ").split())
        except ValueError as exc:
            raise forms.ValidationError(f"{field}: whole numbers, separated by commas.") from exc
        if any(n <= 0 for n in numbers):
            raise forms.ValidationError(f"{field}: positive numbers.")
        return numbers

    def clean_chunk_sizes(self) -> tuple[int, ...]:
        sizes = self._ints(self.cleaned_data["chunk_sizes"], "chunk sizes")
        if not sizes:
            raise forms.ValidationError("at least one chunk size.")
        return sizes

    def clean_capacity_rate_scales(self) -> list[float]:
        try:
            scales = [float(v) for v in (self.cleaned_data.get("capacity_rate_scales") or "").replace(",", " ").split()]
        except ValueError as exc:
            raise forms.ValidationError("numbers, separated by commas.") from exc
        return scales

    def clean_budgets(self) -> tuple[int, ...]:
        return self._ints(self.cleaned_data.get("budgets") or "", "budgets")

    def clean_short_prompt_thresholds(self) -> tuple[int, ...]:
        return self._ints(self.cleaned_data.get("short_prompt_thresholds") or "", "short prompt thresholds")
