"""The profile form: one input per knob of the engine contract, validated by
the contract itself (``profile_errors``), errors shown beside each knob."""

from __future__ import annotations

import dataclasses
from typing import Any

from django import forms

from controlplane.profiles.models import ENGINE_KIND_CHOICES, Profile, ProfileRevision
from workers.profile import PREFILL_MODES, EngineProfile, profile_errors

KNOB_HELP = {
    "prefill_mode": "chunked: prefill chunks share each step's budget with decodes; monolithic: a whole prompt "
    "per step",
    "max_num_batched_tokens": "token budget of one step (decode tokens + prefill chunk tokens)",
    "long_prefill_token_threshold": "most prompt tokens one request may prefill per step (its chunk size); "
    "empty: the whole budget",
    "short_prompt_threshold": "prompts at or below this are prefilled whole (reference engine only)",
    "min_prefill_tokens_per_step": "while a prefill waits, at least this many prefill tokens run each step "
    "(reference engine only)",
    "max_num_seqs": "most requests running at once",
    "block_size": "KV cache block size in tokens (a power of two)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "kv_cache_bytes": "KV cache size in bytes; empty: the engine's default",
}


def _knob_field(field: dataclasses.Field[Any]) -> forms.Field:
    help_text = KNOB_HELP.get(field.name, "")
    if field.name == "prefill_mode":
        return forms.ChoiceField(choices=[(m, m) for m in PREFILL_MODES], help_text=help_text)
    if field.type in ("bool",) or isinstance(field.default, bool):
        return forms.BooleanField(required=False, help_text=help_text)
    # Integers: the contract judges the values, so no min_value here (one
    # message, from one place).
    return forms.IntegerField(required=field.default is not None, help_text=help_text)


class ProfileForm(forms.Form):
    name = forms.SlugField(max_length=100, help_text="letters, digits, - and _")
    engine_kind = forms.ChoiceField(choices=ENGINE_KIND_CHOICES)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    comment = forms.CharField(required=False, max_length=500, help_text="why this change, for the revision history")

    def __init__(self, data: Any = None, *, profile: Profile | None, initial_fields: dict[str, Any] | None) -> None:
        self.profile = profile
        initial = dict(initial_fields or EngineProfile().to_dict())
        super().__init__(data, initial=initial)
        for field in dataclasses.fields(EngineProfile):
            self.fields[field.name] = _knob_field(field)
        if profile is not None:
            # Name and kind belong to the profile; this form adds a revision.
            for name in ("name", "engine_kind", "description"):
                del self.fields[name]

    @property
    def knob_names(self) -> list[str]:
        return EngineProfile.field_names()

    def knob_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in self.knob_names]

    def knobs(self) -> dict[str, Any]:
        return {name: self.cleaned_data.get(name) for name in self.knob_names}

    def profile_attrs(self) -> dict[str, Any]:
        return {k: self.cleaned_data[k] for k in ("name", "engine_kind", "description")}

    def knobs_changed(self, latest: ProfileRevision | None) -> bool:
        normalized = EngineProfile.from_dict(
            self.knobs(), engine_kind=self.profile.engine_kind if self.profile else "reference"
        ).to_dict()
        return latest is None or normalized != latest.fields

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        if Profile.objects.filter(name=name).exists():
            raise forms.ValidationError("a profile with this name exists.")
        return name

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if any(name in self.errors for name in self.knob_names):
            return cleaned  # a knob that is not even a number: the contract cannot judge yet
        knobs = self.knobs()
        if self.profile is not None:
            errors = self.profile.revision_errors(knobs)
        else:
            errors = profile_errors(knobs, engine_kind=cleaned.get("engine_kind", "reference"))
        for name, reasons in errors.items():
            for reason in reasons:
                self.add_error(name if name in self.fields else None, reason)
        return cleaned
