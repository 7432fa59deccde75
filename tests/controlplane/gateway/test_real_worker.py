"""Through the gateway to a real worker (``python -m workers serve``, the
reference engine on the tiny model): what the official OpenAI client gets
is what it would get from the worker directly, token for token."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from controlplane.gateway.models import ClientKey, RequestLog
from tests.controlplane.gateway.factories import routed_reference_worker

pytestmark = pytest.mark.django_db(transaction=True)

PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 256,
    "long_prefill_token_threshold": 64,
    "max_num_seqs": 8,
    "block_size": 32,
    "kv_cache_bytes": 32 << 20,
}
PROMPT = "def fibonacci(n):\n    "


def _stream_text(chunks: list[Any], chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_streams_from_a_real_worker_arrive_intact_through_the_openai_client(
    tiny_model, start_gateway, tmp_path
) -> None:
    with routed_reference_worker(tiny_model, tmp_path, 2048, PROFILE) as url:
        key = ClientKey.issue("app")[1]
        with start_gateway() as gw:
            direct = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            via = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
            for chat in (False, True):
                seen = []
                for client in (direct, via):
                    if chat:
                        chunks = list(
                            client.chat.completions.create(
                                model="tiny",
                                messages=[{"role": "user", "content": PROMPT}],
                                max_tokens=16,
                                temperature=0,
                                stream=True,
                                extra_body={"ignore_eos": True},
                            )
                        )
                    else:
                        chunks = list(
                            client.completions.create(
                                model="tiny",
                                prompt=PROMPT,
                                max_tokens=16,
                                temperature=0,
                                stream=True,
                                extra_body={"ignore_eos": True},
                            )
                        )
                    # How many tokens share an event depends on the worker's timing;
                    # the text, how it ends and the absence of usage must not.
                    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
                    seen.append((_stream_text(chunks, chat), finishes[-1], {c.usage for c in chunks}))
                assert seen[0] == seen[1]
                assert seen[1][0] and seen[1][1:] == ("length", {None})
            with_usage = list(
                via.completions.create(
                    model="tiny",
                    prompt=PROMPT,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
            )
            assert with_usage[-1].usage.completion_tokens == 8
            whole = via.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert (
                whole.choices[0].text
                == direct.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
                )
                .choices[0]
                .text
            )
            deadline = time.monotonic() + 10
            while RequestLog.objects.count() < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
    rows = list(RequestLog.objects.order_by("created_at"))
    assert [r.status for r in rows] == [200] * 4
    completion = rows[0]
    assert completion.stream and completion.output_tokens == 16 and completion.prompt_tokens > 1
    assert completion.cached_tokens is not None
    assert 0 < completion.ttft_seconds < completion.e2e_seconds and completion.max_gap_seconds > 0
