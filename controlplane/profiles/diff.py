"""Field-by-field comparison of two engine profiles. Pure: no Django."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.profile import EngineProfile

_MISSING: Any = object()


@dataclass(frozen=True)
class FieldChange:
    field: str
    before: Any
    after: Any

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "before": self.before, "after": self.after}


def diff_fields(
    before: Mapping[str, Any], after: Mapping[str, Any], *, include_unchanged: bool = False
) -> list[FieldChange]:
    """The fields whose values differ, in the engine contract's field order
    (unknown keys after, sorted). A key missing on one side reads as None,
    the contract's "not set"."""
    order = EngineProfile.field_names()
    extra = sorted((set(before) | set(after)) - set(order))
    rows = [FieldChange(name, before.get(name), after.get(name)) for name in order + extra]
    return rows if include_unchanged else [row for row in rows if row.changed]
