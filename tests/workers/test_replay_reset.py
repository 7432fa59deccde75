"""``POST /reset_prefix_cache`` on a real worker: a prompt sent again hits
the prefix cache; after a reset the same prompt is computed cold again, as
an experiment's next arm (or repeat) must see it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.workers.server.support import get, metric_value, worker

PROMPT_IDS = list(range(100, 100 + 128))  # four whole 32-token blocks


@pytest.fixture(scope="module", params=["reference", pytest.param("vllm", marks=pytest.mark.vllm)])
def server(request, tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"reset-{request.param}") / "worker.log"
    profile = {"enable_prefix_caching": True, "block_size": 32}  # vLLM on CPU wants 32
    with worker(
        tiny_model, log, engine=request.param, profile=json.dumps(profile), extra=["--max-model-len", "512"]
    ) as (url, _):
        yield url


def hits(url: str) -> float:
    return metric_value(get(f"{url}/metrics").text, "vllm:prefix_cache_hits_total") or 0.0


def send(url: str) -> None:
    model = get(f"{url}/v1/models").json()["data"][0]["id"]
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_a_reset_makes_the_next_request_compute_its_prompt_cold(server: str) -> None:
    send(server)
    before = hits(server)
    send(server)
    warm = hits(server) - before
    assert warm >= 96  # the second send hit (at least) its first three blocks

    r = httpx.post(f"{server}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}
    before = hits(server)
    send(server)
    assert hits(server) - before == 0

    send(server)  # and the cache fills again from there
    assert hits(server) - before >= 96


def test_reset_is_a_post(server: str) -> None:
    assert get(f"{server}/reset_prefix_cache").status_code == 405
