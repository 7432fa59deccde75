"""OpenAI request parsing: every bad request names its parameter, in OpenAI's shape."""

import pytest

from workers.openai_error import ApiError
from workers.server import protocol as p


def error_of(fn, *args):
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_malformed_json_is_a_400_in_openai_shape():
    err = error_of(p.parse_json, b'{"prompt": ')
    assert err.status == 400
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_a_json_array_body_is_refused():
    assert error_of(p.parse_json, b"[1, 2]").status == 400


def test_missing_messages_names_the_parameter():
    err = error_of(p.parse_chat, {"model": "m"})
    assert (err.status, err.param) == (400, "messages")


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 3}]])
def test_malformed_messages_are_refused(messages):
    assert error_of(p.parse_chat, {"messages": messages}).status == 400


def test_unknown_model_is_refused_and_an_omitted_one_means_the_served_one():
    err = error_of(p.check_model, {"model": "gpt-9"}, ("tiny-model", "/models/tiny"))
    assert (err.status, err.param, err.code) == (400, "model", "model_not_found")
    p.check_model({}, ("tiny-model",))
    p.check_model({"model": "/models/tiny"}, ("tiny-model", "/models/tiny"))


def test_max_tokens_beyond_the_context_names_max_tokens():
    err = p.context_error(max_model_len=128, num_prompt_tokens=100, max_tokens=50, kind="completion")
    assert err is not None and err.param == "max_tokens" and "128" in err.message
    assert p.context_error(128, 100, 28, "completion") is None
    assert p.context_error(128, 128, None, "chat").param == "messages"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_fields_name_their_parameter(body, param):
    assert error_of(p.parse_completion, body).param == param


def test_prompts_may_be_text_token_ids_or_batches_of_either():
    assert p.parse_completion({"prompt": "hi"}).prompts == ["hi"]
    assert p.parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert p.parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert p.parse_completion({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]


def test_completion_defaults_follow_openai_and_chat_runs_to_the_context():
    assert p.parse_completion({"prompt": "x"}).params.max_tokens == 16
    chat = p.parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert chat.params.max_tokens is None
    assert (
        p.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7}).params.max_tokens
        == 7
    )


def test_stream_options_include_usage_is_read_only_when_streaming():
    req = p.parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.include_usage


def test_text_parts_of_a_message_are_joined():
    chat = p.parse_chat(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert chat.messages == [{"role": "user", "content": "a\nb"}]


def test_vllm_sampling_extensions_are_accepted():
    params = p.parse_completion(
        {"prompt": "x", "top_k": 5, "ignore_eos": True, "stop_token_ids": [7], "seed": 3}
    ).params
    assert (params.top_k, params.ignore_eos, params.stop_token_ids, params.seed) == (5, True, [7], 3)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "a", "temperature": NaN}', "temperature"),
        (b'{"prompt": "a", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "a", "top_p": NaN}', "top_p"),
        (b'{"prompt": "a", "top_p": -Infinity}', "top_p"),
        (b'{"prompt": "a", "seed": 1180591620717411303424}', "seed"),  # 2**70
        (b'{"prompt": "a", "seed": -9223372036854775809}', "seed"),  # -(2**63) - 1
        (b'{"prompt": "a", "top_k": -2}', "top_k"),
        (b'{"prompt": "a", "presence_penalty": 3}', "presence_penalty"),
        (b'{"prompt": "a", "frequency_penalty": NaN}', "frequency_penalty"),
        (b'{"prompt": "a", "repetition_penalty": 0}', "repetition_penalty"),
        (b'{"prompt": "a", "repetition_penalty": 1.2}', "repetition_penalty"),  # in range, not implemented
        (b'{"prompt": "a", "min_p": 2}', "min_p"),
        (b'{"prompt": "a", "stop_token_ids": [-1]}', "stop_token_ids"),
    ],
)
def test_sampling_parameters_are_checked_as_vllm_checks_them_and_name_the_field(body: bytes, param: str) -> None:
    err = error_of(lambda: p.parse_completion(p.parse_json(body)))
    assert (err.status, err.param) == (400, param)


def test_a_tiny_positive_temperature_is_raised_to_vllms_floor_and_zero_stays_greedy() -> None:
    assert p.parse_completion({"prompt": "a", "temperature": 1e-40}).params.temperature == p.MIN_TEMPERATURE
    assert p.parse_completion({"prompt": "a", "temperature": 0}).params.temperature == 0.0
    assert p.parse_completion({"prompt": "a", "temperature": 0.7}).params.temperature == 0.7


def test_the_seed_takes_vllms_64_bit_range_and_minus_one_means_none() -> None:
    assert p.parse_completion({"prompt": "a", "seed": 2**63 - 1}).params.seed == 2**63 - 1
    assert p.parse_completion({"prompt": "a", "seed": -(2**63)}).params.seed == -(2**63)
    assert p.parse_completion({"prompt": "a", "seed": -1}).params.seed is None


def test_neutral_penalties_are_accepted() -> None:
    p.parse_chat({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0, "frequency_penalty": 0.0})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "a\\ud800b"}', "prompt"),
        (b'{"prompt": ["ok", "x\\udfff"]}', "prompt[1]"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        (b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop[0]"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(body: bytes, param: str) -> None:
    err = error_of(p.parse_json, body)
    assert (err.status, err.param) == (400, param)
    assert "surrogate" in err.message


def test_a_surrogate_pair_is_text_and_passes() -> None:
    assert p.parse_json(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001f600"


def test_a_body_nested_to_the_limit_parses_and_one_level_more_is_a_400():
    def nested(levels: int) -> bytes:  # the body object itself is level 1
        return b'{"prompt": "x", "user": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"

    assert p.parse_json(nested(p.MAX_JSON_DEPTH))["prompt"] == "x"
    err = error_of(p.parse_json, nested(p.MAX_JSON_DEPTH + 1))
    assert (err.status, err.code) == (400, "invalid_json")


# ---- the rules shared with the gateway (workers/openai_rules.py) ----------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "a", "best_of": 2}', "best_of"),
        (b'{"prompt": "a", "suffix": "!"}', "suffix"),
        (b'{"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}', "tools"),
        (b'{"prompt": "a", "tool_choice": "auto"}', "tool_choice"),
        (b'{"prompt": "a", "response_format": {"type": "json_object"}}', "response_format"),
        (b'{"prompt": "a", "logit_bias": "x"}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"1": NaN}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"1": 101}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"one": 1}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"-1": 1}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"1": true}}', "logit_bias"),
        (b'{"prompt": "a", "logit_bias": {"99999999999999999999": 1}}', "logit_bias"),
        (b'{"prompt": "a", "min_tokens": -1}', "min_tokens"),
        (b'{"prompt": "a", "min_tokens": 1180591620717411303424}', "min_tokens"),  # 2**70
        (b'{"prompt": "a", "min_tokens": 1.5}', "min_tokens"),
        (b'{"prompt": "a", "min_tokens": 9, "max_tokens": 8}', "min_tokens"),
        (b'{"prompt": "a", "min_tokens": 17}', "min_tokens"),  # past a completion's default of 16
    ],
)
def test_a_worker_called_directly_refuses_what_the_gateway_refuses(body: bytes, param: str) -> None:
    err = error_of(lambda: p.parse_completion(p.parse_json(body)))
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")


def test_chat_bounds_min_tokens_by_max_completion_tokens() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "min_tokens": 9}
    assert error_of(p.parse_chat, {**chat, "max_completion_tokens": 8, "max_tokens": 99}).param == "min_tokens"
    assert p.parse_chat(chat).params.min_tokens == 9  # no limit asked: up to the context


def test_logit_bias_and_min_tokens_reach_the_engine() -> None:
    params = p.parse_completion(
        {"prompt": "a", "max_tokens": 8, "min_tokens": 8, "logit_bias": {"5": -100, "7": 2.5}}
    ).params
    assert (params.min_tokens, params.logit_bias) == (8, {5: -100.0, 7: 2.5})
    assert p.parse_completion({"prompt": "a"}).params.logit_bias == {}
