"""The worker's OpenAI API, through the official client, for both engines.

One worker per engine for the whole module (vLLM's start is the slow part).
"""

import asyncio
import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.workers.server.support import get, metric_names, metric_value, wait_until, worker

# Small enough that a dozen concurrent requests pass the queue bound.
PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 256,
    "long_prefill_token_threshold": 64,
    "max_num_seqs": 4,
    "block_size": 32,
    "kv_cache_bytes": 32 << 20,
}
MAX_MODEL_LEN = 2048
MAX_QUEUE = 2
VOCABULARY_NAMES = {  # "Metrics" in docs/architecture.md
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:iteration_tokens_total",
    "chunkpilot:time_to_first_token_seconds",
    "chunkpilot:inter_token_latency_seconds",
    "chunkpilot:request_time_per_output_token_seconds",
    "chunkpilot:request_max_gap_seconds",
    "chunkpilot:engine_request_max_gap_seconds",
    "chunkpilot:stream_merged_deltas_total",
    "chunkpilot:delivery_lag_seconds",
    "chunkpilot:decode_gap_long_prefill_seconds",
    "chunkpilot:decode_gap_other_seconds",
    "chunkpilot:long_prefill_tokens",
    "chunkpilot:max_model_len",
    "chunkpilot:prefill_chunk_wait_seconds",
    "chunkpilot:kv_fragmentation_ratio",
    "chunkpilot:kv_fragmentation_ratio_seconds_total",
    "chunkpilot:memory_bytes",
    "chunkpilot:memory_recent_peak_bytes",
    "chunkpilot:memory_byte_seconds_total",
    "chunkpilot:held_seconds_total",
    "chunkpilot:step_tokens_total",
    "chunkpilot:steps_total",
    "chunkpilot:profile_info",
}
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module", params=["reference", pytest.param("vllm", marks=pytest.mark.vllm)])
def server(request, tiny_model, tmp_path_factory):
    engine = request.param
    log = tmp_path_factory.mktemp(f"worker-{engine}") / "worker.log"
    with worker(
        tiny_model,
        log,
        engine=engine,
        profile=json.dumps(PROFILE),
        extra=["--max-model-len", str(MAX_MODEL_LEN), "--max-queue", str(MAX_QUEUE), "--served-model-name", "tiny"],
    ) as (url, proc):
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_completions_and_chat_through_the_openai_client(client):
    done = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.object == "text_completion" and done.model == "tiny"
    assert done.choices[0].finish_reason == "length" and done.choices[0].text
    assert done.usage.completion_tokens == 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + 8

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6 and chat.usage.prompt_tokens > 4


def test_chat_prompt_is_the_models_chat_template_tokenized_once(server, tiny_model):
    """The messages go through the checkpoint's template, as transformers renders
    and tokenizes it: the template writes the BOS, so none is added on top."""
    import transformers

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert expected.count(tokenizer.bos_token_id) == 1
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    done = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    assert done["choices"][0]["prompt_token_ids"] == expected
    assert done["usage"]["prompt_tokens"] == len(expected)


def test_streaming_delivers_the_same_text_in_order_with_usage_last(client):
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])

    chat_chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].usage.completion_tokens == 5
    assert chat_chunks[-2].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4}, "messages"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN},
            "max_tokens",
        ),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, "model"),
        ("/v1/completions", b'{"model": "tiny", "prompt": ', None),
    ],
    ids=[
        "missing-messages",
        "max-tokens-beyond-model",
        "chat-max-tokens-beyond-model",
        "unknown-model",
        "malformed-json",
    ],
)
def test_bad_requests_get_400_in_openai_error_shape(server, path, body, param):
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=10)
    else:
        r = httpx.post(server + path, json=body, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_the_official_client_raises_bad_request_for_an_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert info.value.body["param"] == "model"


def load(server):
    return get(f"{server}/health").json()["load"]


def test_a_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(server):
    body = {"model": "tiny", "prompt": "word " * 150, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        held = load(server)
        assert held["num_requests_running"] == 1 and held["kv_cache_usage_perc"] > 0
    # The connection is closed: the engine must drop the request and its blocks.
    wait_until(lambda: load(server)["num_requests_running"] == 0 and load(server)["kv_cache_usage_perc"] == 0)
    assert load(server)["num_in_flight"] == 0
    text = get(f"{server}/metrics").text
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0
    assert metric_value(text, "vllm:num_requests_running") == 0


def test_past_the_queue_bound_requests_get_429_with_retry_after(server):
    capacity = PROFILE["max_num_seqs"] + MAX_QUEUE

    async def burst():
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:

            async def one(i):
                body = {"model": "tiny", "prompt": f"{i} " * 50, "max_tokens": 300, "ignore_eos": True}
                return await http.post("/v1/completions", json=body)

            return await asyncio.gather(*(one(i) for i in range(capacity + 4)))

    replies = asyncio.run(burst())
    refused = [r for r in replies if r.status_code == 429]
    assert len(refused) >= 4 - 1  # at least the surplus, give or take one that finished early
    assert all(r.status_code in (200, 429) for r in replies)
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert sum(r.status_code == 200 for r in replies) <= capacity


def test_more_prompts_than_the_worker_can_ever_hold_is_a_400_naming_the_limit(server):
    capacity = PROFILE["max_num_seqs"] + MAX_QUEUE
    body = {"model": "tiny", "prompt": ["hi"] * (capacity + 1), "max_tokens": 1}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "too_many_prompts")
    assert f"at most {capacity}" in error["message"]
    fits = httpx.post(f"{server}/v1/completions", json={**body, "prompt": ["hi"] * 2}, timeout=60)
    assert fits.status_code == 200


def test_metrics_carry_every_design_name_and_the_running_profile(server, client):
    # The long prompt arrives while another request decodes: vLLM (0.32)
    # lifts long_prefill_token_threshold for a request that runs alone, as
    # there is no one for it to starve; beside a decode it is cut to the cap.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(
            client.completions.create,
            model="tiny",
            prompt="hello",
            max_tokens=120,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        wait_until(lambda: metric_value(get(f"{server}/metrics").text, "vllm:num_requests_running") == 1)
        client.completions.create(model="tiny", prompt="word " * 200, max_tokens=4, temperature=0)
        decoding.result()
    text = get(f"{server}/metrics").text
    assert VOCABULARY_NAMES <= metric_names(text)
    assert metric_value(text, "chunkpilot:profile_info", prefill_mode="chunked", budget="256", chunk_cap="64") == 1
    assert metric_value(text, "chunkpilot:step_tokens_total", kind="prefill") > 200
    assert (
        metric_value(text, "chunkpilot:memory_recent_peak_bytes") >= metric_value(text, "chunkpilot:memory_bytes") > 0
    )
    # 200+ prompt tokens at a 64-token chunk cap: at least four chunks waited.
    assert metric_value(text, "chunkpilot:prefill_chunk_wait_seconds_count") >= 4


def test_metrics_named_in_the_query_are_the_only_ones_served(server, client):
    client.completions.create(model="tiny", prompt="word " * 20, max_tokens=2, temperature=0)
    whole = get(f"{server}/metrics").text
    names = ["chunkpilot:memory_recent_peak_bytes", "vllm:time_to_first_token_seconds_bucket"]
    only = get(f"{server}/metrics", params=[("name[]", n) for n in names]).text
    # A histogram is named by one of its samples and comes whole.
    assert metric_names(only) == {"chunkpilot:memory_recent_peak_bytes", "vllm:time_to_first_token_seconds"}
    assert metric_value(only, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric_value(only, "chunkpilot:memory_recent_peak_bytes") > 0
    assert len(only) < len(whole) / 10


def test_health_and_models(server):
    health = get(f"{server}/health")
    assert health.status_code == 200 and health.json()["status"] == "ready"
    assert health.json()["profile"]["fields"]["max_num_batched_tokens"] == 256
    models = get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
