"""The engine's facts reach the request log: through a real gateway to a real
reference worker, each row holds what the worker reported under the
``chunkpilot`` key (chunked and whole prompts, streamed and not, and a
stream whose usage event the gateway asked for and dropped)."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from controlplane.gateway.facts import take_facts
from controlplane.gateway.models import ClientKey, RequestLog
from controlplane.gateway.record import RequestRecord
from tests.controlplane.gateway.factories import routed_reference_worker

PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 64,
    "long_prefill_token_threshold": 32,
    "max_num_seqs": 4,
    "block_size": 16,
    "kv_cache_bytes": 16 << 20,
    "enable_prefix_caching": False,
}
LONG_PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 6
SHORT_PROMPT = "hi"


def _assert_row_holds(row: RequestLog, facts: dict[str, Any]) -> None:
    assert row.prefill_mode == facts["prefill_mode"] == "chunked"
    assert row.prompt_split is facts["prompt_split"]
    assert row.num_prefill_chunks == facts["num_prefill_chunks"]
    assert row.computed_tokens == facts["num_computed_tokens"]
    assert row.preemptions == facts["num_preemptions"]
    assert row.queue_seconds == pytest.approx(facts["queue_seconds"])
    assert row.prefill_seconds == pytest.approx(facts["prefill_seconds"])
    assert row.timeline is not None and row.timeline["chunks"] == facts["prefill_chunks"]


@pytest.mark.django_db(transaction=True)
def test_the_log_stores_the_facts_the_worker_reported(tiny_model, start_gateway, tmp_path) -> None:
    with routed_reference_worker(tiny_model, tmp_path, 512, PROFILE):
        key = ClientKey.issue("app")[1]
        with start_gateway() as gw:
            via = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
            seen: dict[str, dict[str, Any]] = {}
            for name, prompt in (("chunked", LONG_PROMPT), ("whole", SHORT_PROMPT)):
                chunks = list(
                    via.completions.create(
                        model="tiny",
                        prompt=prompt,
                        max_tokens=6,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                        extra_headers={"x-request-id": f"{name}-stream"},
                    )
                )
                seen[f"{name}-stream"] = (chunks[-1].model_extra or {})["chunkpilot"]
                done = via.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=6,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                    extra_headers={"x-request-id": f"{name}-whole"},
                )
                seen[f"{name}-whole"] = (done.model_extra or {})["chunkpilot"]
            # The client did not ask for usage: the gateway did, and dropped the event again.
            plain = list(
                via.completions.create(
                    model="tiny",
                    prompt=LONG_PROMPT,
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={"x-request-id": "plain"},
                )
            )
            assert all(c.usage is None for c in plain)
            deadline = time.monotonic() + 15
            while RequestLog.objects.count() < 5 and time.monotonic() < deadline:
                time.sleep(0.1)
    rows = {r.request_id: r for r in RequestLog.objects.all()}
    assert set(rows) == {*seen, "plain"}
    for request_id, facts in seen.items():
        _assert_row_holds(rows[request_id], facts)
    assert rows["chunked-stream"].prompt_split is True and rows["chunked-stream"].num_prefill_chunks > 1
    assert rows["whole-stream"].prompt_split is False and rows["whole-stream"].num_prefill_chunks == 1
    assert rows["plain"].prompt_split is True and rows["plain"].prefill_mode == "chunked"
    # A stream's timeline has the gaps the client saw, one per token event after the first.
    gaps = rows["chunked-stream"].timeline["gaps"]
    assert len(gaps) >= 1 and max(gaps) == pytest.approx(rows["chunked-stream"].max_gap_seconds, abs=1e-6)


def test_facts_of_the_wrong_shape_are_left_empty_never_guessed() -> None:
    rec = RequestRecord(request_id="r", created_at=0.0, model="m", profile_revision_id=7)
    take_facts(
        rec,
        {
            "prefill_mode": "sideways",
            "prompt_split": "yes",
            "num_prefill_chunks": -1,
            "queue_seconds": "soon",
            "profile_revision_id": None,
            "prefill_chunks": [[0.1, 3], ["x", 1]],
        },
    )
    assert (rec.prefill_mode, rec.prompt_split, rec.num_prefill_chunks, rec.queue_seconds) == ("", None, None, None)
    assert rec.profile_revision_id == 7  # the worker did not say: the routing snapshot's stands
    assert rec.timeline == {"chunks": [[0.1, 3]]}
    take_facts(rec, None)
    assert rec.timeline is None
