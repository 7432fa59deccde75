"""The engine's per-request facts, read from a worker's reply into the log row.

A worker sends them under the ``chunkpilot`` key (``workers/server/facts.py``):
in a stream's final usage event (which the meter parses anyway) or in a
whole reply's body. Anything missing or of the wrong type stays null: the
log never holds a guess. Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from controlplane.gateway.meter import Usage
from controlplane.gateway.record import RequestRecord

PREFILL_MODES = ("chunked", "monolithic")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value >= 0 else None


def _chunks(value: Any) -> list[list[float]] | None:
    if not isinstance(value, list):
        return None
    out = []
    for item in value[:1024]:
        if isinstance(item, list) and len(item) == 2 and _float(item[0]) is not None and _int(item[1]) is not None:
            out.append([float(item[0]), int(item[1])])
    return out


def take_facts(rec: RequestRecord, facts: Any, gaps: list[float] | None = None) -> None:
    """Copy what the worker reported (and the client-side gaps) onto ``rec``."""
    timeline: dict[str, Any] = {}
    if gaps:
        timeline["gaps"] = [round(g, 6) for g in gaps]
    if isinstance(facts, dict):
        mode = facts.get("prefill_mode")
        rec.prefill_mode = mode if mode in PREFILL_MODES else ""
        split = facts.get("prompt_split")
        rec.prompt_split = split if isinstance(split, bool) else None
        rec.num_prefill_chunks = _int(facts.get("num_prefill_chunks"))
        rec.computed_tokens = _int(facts.get("num_computed_tokens"))
        rec.queue_seconds = _float(facts.get("queue_seconds"))
        rec.prefill_seconds = _float(facts.get("prefill_seconds"))
        rec.preemptions = _int(facts.get("num_preemptions"))
        revision_id = _int(facts.get("profile_revision_id"))
        if revision_id is not None:
            rec.profile_revision_id = revision_id  # what it ran under, not what the snapshot expected
        chunks = _chunks(facts.get("prefill_chunks"))
        if chunks is not None:
            timeline["chunks"] = chunks
    rec.timeline = timeline or None


def of_body(body: bytes) -> tuple[Usage | None, Any]:
    """Usage and facts of a whole (non-streamed) reply, from one parse."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    return Usage.parse(data.get("usage")), data.get("chunkpilot")
