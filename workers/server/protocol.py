"""OpenAI's request and response JSON, parsed and built without the engine.

Requests become ``CompletionRequest`` (prompts + ``SamplingParams``) or raise
``ApiError`` (``workers/openai_error.py``) with OpenAI's error shape; the
rules the gateway applies too come first (``workers/openai_rules.py``). Responses are plain dicts built the
way OpenAI (and vLLM's server) shapes them; streaming chunks are SSE lines.
Unknown request fields are ignored, as OpenAI-compatible servers do, so
clients that send newer fields keep working.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from workers import openai_rules as rules
from workers.engines.api import SamplingParams
from workers.openai_error import ApiError, bad

# vLLM's extensions to OpenAI's sampling fields, accepted by both engines.
_EXTRA_INT_FIELDS = ("top_k",)
# The seed's range, as vLLM's protocol has it (a 64-bit signed integer; what
# torch.Generator.manual_seed takes); -1 means none, as in vLLM.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Below this a temperature turns logits / temperature into inf and the
# softmax into NaN; vLLM raises such a temperature to it (sampling_params.py
# _MAX_TEMP), and so do we.
MIN_TEMPERATURE = 1e-2


@dataclass
class CompletionRequest:
    kind: str  # "completion" or "chat"
    prompts: list[str | list[int]]
    params: SamplingParams
    max_tokens_given: bool
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)
    add_generation_prompt: bool = True
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and token_ids per choice (not streamed)


# OpenAI's deepest body (messages → content parts → image_url) is five levels;
# the walks below recurse, and a library may raise the interpreter's limit.
MAX_JSON_DEPTH = 32


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise bad("the request body must be a JSON object.", code="invalid_json")
        _check_body(data)
    except RecursionError as exc:  # ``[`` × 100,000: past the interpreter's stack, not a server fault
        raise bad("the request body is nested too deeply.", code="invalid_json") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        # JSONDecodeError, and an integer literal past Python's 4,300-digit limit
        raise bad(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    return data


def _check_body(body: dict[str, Any]) -> None:
    """One walk, without recursion, over the parsed body: it nests at most
    ``MAX_JSON_DEPTH`` levels, and every string is encodable as UTF-8 (JSON's
    ``\\ud800`` escape gives Python a lone surrogate, which tokenizers and the
    reply's own encoder refuse deep inside; refused here with the field named)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path or "body")
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path or "body")
                if isinstance(item, str | list | dict):
                    stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        else:
            for index, item in enumerate(value):
                if isinstance(item, str | list | dict):
                    stack.append((item, f"{path}[{index}]", depth + 1))


def _check_text(text: str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(
            f"`{name}` holds a lone surrogate ({text[exc.start]!a} at {exc.start}): not valid Unicode text.",
            param=name,
        ) from exc


def check_model(data: dict[str, Any], served: tuple[str, ...]) -> None:
    model = data.get("model")
    if model is None:
        return  # one model per worker: an omitted model means that one
    if not isinstance(model, str) or model not in served:
        raise bad(
            f"The model `{model}` does not exist; this worker serves `{served[0]}`.",
            param="model",
            code="model_not_found",
        )


def _number(data: dict[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"`{name}` must be a number.", param=name)
    if not math.isfinite(value):
        raise bad(f"`{name}` must be a finite number; got {value}.", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise bad(f"`{name}` must be in {bracket}{lo}, {hi}]; got {value}.", param=name)
    return float(value)


def _int(
    data: dict[str, Any], name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"`{name}` must be an integer.", param=name)
    if lo is not None and value < lo:
        raise bad(f"`{name}` must be at least {lo}; got {value}.", param=name)
    if hi is not None and value > hi:
        raise bad(f"`{name}` must be at most {hi}; got {value}.", param=name)
    return value


def _temperature(data: dict[str, Any]) -> float:
    value = _number(data, "temperature", 1.0, 0.0, 2.0)
    if 0.0 < value < MIN_TEMPERATURE:
        return MIN_TEMPERATURE  # vLLM's clamp: finite logits / temperature
    return value


def _seed(data: dict[str, Any]) -> int | None:
    seed = _int(data, "seed", None, lo=SEED_MIN, hi=SEED_MAX)
    return None if seed == -1 else seed


def _bool(data: dict[str, Any], name: str, default: bool = False) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"`{name}` must be true or false.", param=name)
    return value


def _sampling(data: dict[str, Any], max_tokens: int | None, logprobs: bool, *, chat: bool) -> SamplingParams:
    stop = data.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = [s for s in stop if s]
    else:
        raise bad("`stop` must be a string or a list of strings.", param="stop")
    stop_token_ids = data.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= SEED_MAX for t in stop_token_ids
    ):
        raise bad("`stop_token_ids` must be a list of non-negative integers.", param="stop_token_ids")
    n = _int(data, "n", 1, lo=1)
    if n != 1:
        raise bad("only n=1 is supported.", param="n")
    top_k = _int(data, "top_k", 0, lo=-1)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_temperature(data),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k or 0, 0),
        seed=_seed(data),
        stop=stops,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=_bool(data, "ignore_eos"),
        logprobs=0 if logprobs else None,
        include_stop_str_in_output=_bool(data, "include_stop_str_in_output"),
        min_tokens=rules.min_tokens(data, chat=chat),
        logit_bias=rules.logit_bias(data),
    )


def parse_completion(data: dict[str, Any]) -> CompletionRequest:
    """POST /v1/completions."""
    rules.check_request(data, chat=False)
    if "prompt" not in data:
        raise bad("`prompt` is required.", param="prompt")
    prompt = data["prompt"]
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
        )
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise bad(
            "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists.",
            param="prompt",
        )
    if any(p == "" for p in prompts):
        raise bad("`prompt` must not be empty.", param="prompt")
    stream = _bool(data, "stream")
    max_tokens = _int(data, "max_tokens", None, lo=1)
    logprobs = _int(data, "logprobs", None, lo=0)
    if logprobs is not None and logprobs > 1:
        raise bad("only the chosen token's logprob is available: `logprobs` may be 0 or 1.", param="logprobs")
    return CompletionRequest(
        kind="completion",
        prompts=prompts,
        params=_sampling(data, 16 if max_tokens is None else max_tokens, logprobs is not None, chat=False),
        max_tokens_given=True,  # OpenAI's default for completions is 16
        stream=stream,
        include_usage=rules.include_usage(data),
        echo=_bool(data, "echo"),
        logprobs=logprobs is not None,
        return_token_ids=_bool(data, "return_token_ids"),
    )


def _message_text(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad(f"`{param}` must be an object with `role` and `content`.", param=param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad(f"`{param}.role` is required.", param=f"{param}.role")
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"`{param}.content` parts must be text parts.", param=f"{param}.content")
            parts.append(part["text"])
        text = "\n".join(parts)
    else:
        raise bad(f"`{param}.content` must be a string or a list of text parts.", param=f"{param}.content")
    return {"role": role, "content": text}


def parse_chat(data: dict[str, Any]) -> CompletionRequest:
    """POST /v1/chat/completions."""
    rules.check_request(data, chat=True)
    messages = data.get("messages")
    if messages is None:
        raise bad("`messages` is required.", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad("`messages` must be a non-empty list.", param="messages")
    parsed = [_message_text(m, i) for i, m in enumerate(messages)]
    stream = _bool(data, "stream")
    max_tokens = _int(data, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _int(data, "max_tokens", None, lo=1)
    logprobs = _bool(data, "logprobs")
    top_logprobs = _int(data, "top_logprobs", None, lo=0)
    if top_logprobs:
        raise bad("only the chosen token's logprob is available: `top_logprobs` must be 0.", param="top_logprobs")
    return CompletionRequest(
        kind="chat",
        prompts=[],
        params=_sampling(data, max_tokens, logprobs, chat=True),
        max_tokens_given=max_tokens is not None,
        stream=stream,
        include_usage=rules.include_usage(data),
        logprobs=logprobs,
        messages=parsed,
        add_generation_prompt=_bool(data, "add_generation_prompt", True),
        return_token_ids=_bool(data, "return_token_ids"),
    )


def context_error(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, kind: str) -> ApiError | None:
    """vLLM's message for a request that does not fit the context."""
    where = "messages" if kind == "chat" else "prompt"
    if num_prompt_tokens >= max_model_len:
        return bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} has "
            f"{num_prompt_tokens} tokens, leaving no room for a completion. Please reduce the length of the {where}.",
            param=where,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        return bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {where}, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return None


# ---- responses -------------------------------------------------------------


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int) -> dict[str, Any]:
    offsets = []
    position = offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=False)],
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=False)
        ]
    }


def now_seconds() -> int:
    return int(time.time())


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
