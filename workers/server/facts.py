"""Per-request engine facts, handed to the gateway with each response.

They travel under the ``chunkpilot`` extension key: in the final usage
chunk of a stream, in the body of a whole reply. OpenAI's clients ignore
keys they do not know (the official ``openai`` package keeps them as extra
fields), so nothing else changes for them. What an engine does not know is
null, never a guess: vLLM's per-request stats have no chunk list, so its
``prefill_chunks``, ``num_prefill_chunks`` and ``prompt_split`` are null.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from workers.engines.api import RequestMetrics

EXTENSION_KEY = "chunkpilot"


def _seconds(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else max(0.0, later - earlier)


def request_facts(
    metrics: RequestMetrics | None,
    *,
    engine_kind: str,
    prefill_mode: str,
    profile_name: str,
    profile_revision: int | None,
    profile_revision_id: int | None,
    num_prompts: int = 1,
) -> dict[str, Any]:
    """The facts of one request (its first prompt when a completion has several)."""
    facts: dict[str, Any] = {
        "engine": engine_kind,
        "prefill_mode": prefill_mode,
        "profile": profile_name,
        "profile_revision": profile_revision,
        "profile_revision_id": profile_revision_id,
        "num_prompts": num_prompts,
    }
    if metrics is None:
        return facts
    chunks = metrics.prefill_chunks
    arrival = metrics.arrival_time
    facts.update(
        num_prompt_tokens=metrics.num_prompt_tokens,
        num_cached_tokens=metrics.num_cached_tokens,
        # Tokens the engine ran prefill for: every chunk's when it knows them
        # (recomputes after a preemption count again), else prompt − cached.
        num_computed_tokens=(
            sum(n for _, n in chunks)
            if chunks is not None
            else max(0, metrics.num_prompt_tokens - metrics.num_cached_tokens)
        ),
        num_prefill_chunks=None if chunks is None else len(chunks),
        prompt_split=None if chunks is None else len(chunks) > 1,
        queue_seconds=_seconds(metrics.first_scheduled_time, arrival),
        prefill_seconds=_seconds(metrics.first_token_time, metrics.first_scheduled_time),
        num_preemptions=metrics.num_preemptions,
        # Offsets from the engine's arrival, so the gateway can lay them on its own clock.
        prefill_chunks=None if chunks is None else [[round(t - arrival, 6), n] for t, n in chunks],
    )
    return facts
