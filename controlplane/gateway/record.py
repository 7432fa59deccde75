"""What the gateway knows of one client request, on its way to the request
log: the proxy fills it, ``facts.py`` adds the engine's facts, the log
writer stores it. A module of its own so that those three import it and
not one another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One client request as the gateway saw it: a ``RequestLog`` row to be."""

    request_id: str
    created_at: float  # time.time() at arrival
    model: str
    cohort: str = ""
    pool_id: int | None = None
    worker_id: int | None = None
    profile_revision_id: int | None = None
    api_key_id: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    ttft_seconds: float | None = None
    max_gap_seconds: float | None = None
    tpot_seconds: float | None = None
    e2e_seconds: float | None = None
    status: int = 0
    error: str = ""
    stream: bool = False
    # The engine's facts (gateway/facts.py); None where it did not say.
    prefill_mode: str = ""
    prompt_split: bool | None = None
    num_prefill_chunks: int | None = None
    computed_tokens: int | None = None
    queue_seconds: float | None = None
    prefill_seconds: float | None = None
    preemptions: int | None = None
    timeline: dict[str, Any] | None = None  # {"chunks": [[offset s, tokens]], "gaps": [s]}
