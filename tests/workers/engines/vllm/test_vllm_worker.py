"""The vLLM backend behind the worker: its own metrics and ours beside them,
block-level figures from its scheduler, and the profile reaching its flags."""

import json
import subprocess
import time

import httpx
import pytest

from tests.support import PYTHON, ROOT, child_env
from tests.workers.server.support import VLLM_ENV, get, metric_value, worker

PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 128,
    "max_num_seqs": 4,
    "block_size": 32,
    "enable_prefix_caching": False,
    "kv_cache_bytes": 16 << 20,
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "worker.log"
    with worker(tiny_model, log, engine="vllm", profile=json.dumps(PROFILE), extra=["--max-model-len", "2048"]) as (
        url,
        _,
    ):
        yield url


def metrics(url):
    return get(f"{url}/metrics").text


@pytest.mark.vllm
def test_vllms_own_metrics_describe_the_profile_it_runs(server):
    text = metrics(server)
    assert metric_value(text, "vllm:cache_config_info", block_size="32", enable_prefix_caching="False") == 1
    assert metric_value(text, "chunkpilot:profile_info", engine_kind="vllm", budget="128") == 1


@pytest.mark.vllm
def test_a_prompt_runs_in_budget_sized_chunks_and_each_chunk_wait_is_recorded(server):
    before = metrics(server)
    prompt_ids = list(range(10, 10 + 300))  # 300 tokens: chunks of 128, 128, 44
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": prompt_ids, "max_tokens": 2, "ignore_eos": True}, timeout=60
    )
    assert r.status_code == 200
    after = metrics(server)

    def delta(name, **labels):
        return (metric_value(after, name, **labels) or 0) - (metric_value(before, name, **labels) or 0)

    assert delta("chunkpilot:step_tokens_total", kind="prefill") == 300
    assert delta("chunkpilot:prefill_chunk_wait_seconds_count") == 3
    assert (
        delta("chunkpilot:step_tokens_total", kind="decode") == 1
    )  # the second token; the first came with the prefill
    assert delta("vllm:prompt_tokens_total") == 300  # vLLM's own count agrees
    # 300 tokens to compute is long on a 2,048-token model (more than 128): each of its steps ran a long
    # prefill; its one gap (first to second token) came after them, so it is not a long-prefill gap
    assert metric_value(after, "chunkpilot:long_prefill_tokens") == 128
    assert delta("chunkpilot:long_prefill_steps_total") == 3
    assert delta("chunkpilot:decode_gap_other_seconds_count") == 1
    assert delta("chunkpilot:decode_gap_long_prefill_seconds_count") == 0
    assert delta("chunkpilot:time_to_first_token_seconds_count") == 1  # a whole reply: the engine's times


@pytest.mark.vllm
def test_fragmentation_and_memory_follow_the_blocks_a_request_holds(server):
    idle_memory = metric_value(metrics(server), "chunkpilot:memory_bytes")
    body = {"prompt": list(range(10, 110)), "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        samples = []
        for _ in range(4):  # a few scrapes as the request grows token by token
            for _ in range(5):
                next(line for line in lines if line.startswith("data: "))
            samples.append(metrics(server))
        text = samples[-1]
    held_memory = metric_value(text, "chunkpilot:memory_bytes")
    fragmentation = [metric_value(page, "chunkpilot:kv_fragmentation_ratio") for page in samples]
    # 100-odd tokens in four or more 32-token blocks: part of the last block is
    # empty, except at the moments the count is a multiple of 32 (then 0).
    assert all(0 <= f < 0.25 for f in fragmentation) and max(fragmentation) > 0, fragmentation
    assert held_memory > idle_memory
    assert metric_value(text, "chunkpilot:memory_recent_peak_bytes") >= held_memory
    time.sleep(0.3)
    assert metric_value(metrics(server), "chunkpilot:memory_byte_seconds_total") > 0


def test_a_knob_vllm_lacks_is_refused_before_vllm_loads(tiny_model):
    out = subprocess.run(
        [
            PYTHON,
            "-m",
            "workers",
            "serve",
            "--engine",
            "vllm",
            "--model",
            str(tiny_model),
            "--profile",
            json.dumps({"block_size": 32, "short_prompt_threshold": 64}),
        ],
        cwd=ROOT,
        env=child_env(**VLLM_ENV),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "short_prompt_threshold" in out.stderr and "vllm engine has no such knob" in out.stderr
