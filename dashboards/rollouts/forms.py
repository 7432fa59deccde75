"""The "New rollout" form: a target revision, the routing table and its
pools, the analysis template and the consistency gate. ``Rollout.start``
judges the combination; its errors are shown by field."""

from __future__ import annotations

from django import forms

from controlplane.experiments.models import arm_profile_ids
from controlplane.fleet.models import Pool
from controlplane.gateway.models import RoutingTable
from controlplane.profiles.models import ProfileRevision
from controlplane.rollouts.models import AnalysisTemplate


class RolloutForm(forms.Form):
    target_revision = forms.ModelChoiceField(
        queryset=ProfileRevision.objects.exclude(profile__in=arm_profile_ids())  # an experiment's arms: not a target
        .select_related("profile")
        .order_by("profile__name", "-revision"),
        help_text="the profile revision to roll out",
    )
    model = forms.ModelChoiceField(
        queryset=RoutingTable.objects.all(),
        to_field_name="model",
        help_text="the routing table (model name) whose traffic it takes",
    )
    stable_pool = forms.ModelChoiceField(
        queryset=Pool.objects.all(), to_field_name="name", help_text="the pool being moved: the table's stable pool"
    )
    canary_pool = forms.ModelChoiceField(
        queryset=Pool.objects.all(), to_field_name="name", help_text="the table's canary pool"
    )
    baseline_pool = forms.ModelChoiceField(
        queryset=Pool.objects.all(),
        to_field_name="name",
        required=False,
        help_text="optional: fresh workers on the stable revision, to compare with",
    )
    analysis_template = forms.ModelChoiceField(
        queryset=AnalysisTemplate.objects.all(),
        to_field_name="name",
        required=False,
        help_text="for the default plan's analyses; empty: the template named default",
    )
    progress_deadline_seconds = forms.FloatField(
        initial=600, min_value=1, help_text="abort when a step makes no progress this long"
    )
    gate_enabled = forms.BooleanField(
        required=False,
        initial=True,
        label="Consistency gate",
        help_text="replay fixed prompts greedily on canary and stable before a chunked target takes traffic",
    )
