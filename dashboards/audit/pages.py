"""What the audit page shows of each event: the change, not two dict reprs.

``changes(before, after)`` flattens both sides (nested objects to dotted
keys, ``fields.max_num_batched_tokens``) and keeps only what differs, each
side as compact JSON; what stayed the same is counted, not shown."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from controlplane.audit.models import AuditEvent

# Keys past this many, one event shows as "… and N more".
MAX_NUM_CHANGES = 40
# A value longer than this is cut (the API has it whole).
MAX_VALUE_CHARS = 300


@dataclass(frozen=True)
class Change:
    key: str
    before: str | None  # None: the key was not there
    after: str | None

    @property
    def kind(self) -> str:
        return "added" if self.before is None else "removed" if self.after is None else "changed"


@dataclass(frozen=True)
class Diff:
    changes: list[Change]
    num_unchanged: int
    num_more: int


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix or "value": value}


def _show(value: Any) -> str:
    if value == "":
        return '""'  # an empty string, visibly
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def changes(before: Any, after: Any) -> Diff:
    """The keys whose values differ between ``before`` and ``after`` (either
    may be None: a creation or a deletion), in key order."""
    old = _flatten(before) if before not in (None, {}) else {}
    new = _flatten(after) if after not in (None, {}) else {}
    rows = []
    for key in sorted(old.keys() | new.keys()):
        if key in old and key in new and old[key] == new[key]:
            continue
        rows.append(Change(key, _show(old[key]) if key in old else None, _show(new[key]) if key in new else None))
    num_unchanged = len(old.keys() & new.keys()) - sum(1 for r in rows if r.kind == "changed")
    return Diff(rows[:MAX_NUM_CHANGES], num_unchanged, max(0, len(rows) - MAX_NUM_CHANGES))


def rows(events: Iterable[AuditEvent]) -> list[dict[str, Any]]:
    """What ``audit/partials/audit_table.html`` draws: each event and its change."""
    return [{"event": e, "diff": changes(e.before, e.after)} for e in events]
