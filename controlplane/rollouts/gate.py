"""The consistency gate: before a chunked target takes traffic, fixed prompts
are replayed greedily on a canary worker and on a stable worker, and their
token ids must be identical (docs/architecture.md, "Engine contract": chunks are groups of computation,
never a restart of positions, so greedy output cannot change).

The prompts are token-id lists, so their lengths are exact whatever the
tokenizer: by default three, at 1.5, 2.5 and 3.5 chunk caps of the target
(past its ``short_prompt_threshold``, and clipped to what the workers'
context fits), so each crosses one to three chunk boundaries. Ids are drawn
from [16, 1016) by a fixed generator: clear of the special tokens at the
bottom of any vocabulary, inside every vocabulary we serve. An operator may
give their own prompts (token-id lists or strings) in the rollout's
``gate`` settings.

A gate whose prompts are never split proves nothing, so the longest prompt
must cross at least ``MIN_BOUNDARIES`` chunk boundaries, or as many as the
context allows (``required_boundaries``). Creation refuses prompts that
cannot (``prompt_errors``: token-id lists exactly; a string by an upper
bound, its UTF-8 bytes plus a BOS, since no tokenizer makes more tokens than
that), and ``run`` reports an error, never a pass, when the prompts the
workers actually tokenized crossed fewer.

Each replay is a plain ``/v1/completions`` call to the worker itself with
``temperature: 0``, ``ignore_eos`` (so both run the full length) and vLLM's
``return_token_ids`` extension (the choice carries ``token_ids``). The
comparison is pure (``compare``); the HTTP is in ``replay``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

ID_BASE = 16
ID_SPAN = 1000
DEFAULT_MAX_TOKENS = 12
DEFAULT_CHUNK_MULTIPLES = (1.5, 2.5, 3.5)
MIN_BOUNDARIES = 2
TIMEOUT_SECONDS = 120.0

Prompt = str | list[int]


class GateError(Exception):
    """A replay could not be made (worker unreachable, bad reply): not a
    verdict on the target, so the gate is retried."""


@dataclass(frozen=True)
class GateSettings:
    enabled: bool = True
    prompts: tuple[Prompt, ...] = ()  # empty: the default set for the target's chunk cap
    max_tokens: int = DEFAULT_MAX_TOKENS

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> GateSettings:
        data = data or {}
        prompts = tuple(p if isinstance(p, str) else list(p) for p in data.get("prompts") or ())
        return cls(bool(data.get("enabled", True)), prompts, int(data.get("max_tokens", DEFAULT_MAX_TOKENS)))


def settings_errors(data: Any) -> list[str]:
    """Why a posted ``gate`` object cannot be used; empty when it can."""
    if data is None:
        return []
    if not isinstance(data, dict):
        return ["must be an object: {enabled, prompts, max_tokens}."]
    errors = []
    unknown = set(data) - {"enabled", "prompts", "max_tokens"}
    if unknown:
        errors.append(f"unknown keys: {', '.join(sorted(unknown))}.")
    if "enabled" in data and not isinstance(data["enabled"], bool):
        errors.append("enabled must be true or false.")
    max_tokens = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
        errors.append("max_tokens must be an integer from 1 to 256.")
    prompts = data.get("prompts", [])
    if not isinstance(prompts, list) or not all(
        (isinstance(p, str) and p)
        or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p))
        for p in prompts
    ):
        errors.append("prompts must be a list of non-empty strings or token-id lists.")
    return errors


def default_prompts(
    chunk_cap: int, max_model_len: int, max_tokens: int, short_prompt_threshold: int | None = None
) -> list[list[int]]:
    """Token-id prompts crossing 1, 2 and 3 chunk boundaries (more, when
    the target prefills prompts up to ``short_prompt_threshold`` whole),
    each fitting the context with room for the output."""
    limit = context_limit(max_model_len, max_tokens)
    # Whole chunks added so the shortest prompt is past the short-prompt threshold.
    first = int(chunk_cap * DEFAULT_CHUNK_MULTIPLES[0])
    offset = (
        chunk_cap * ((short_prompt_threshold - first) // chunk_cap + 1)
        if short_prompt_threshold is not None and first <= short_prompt_threshold
        else 0
    )
    lengths = []
    for multiple in DEFAULT_CHUNK_MULTIPLES:
        n = int(chunk_cap * multiple) + offset
        if limit is not None:
            n = min(n, limit)
        if n not in lengths:
            lengths.append(n)
    return [_ids(n, seed=i + 1) for i, n in enumerate(lengths)]


def context_limit(max_model_len: int, max_tokens: int) -> int | None:
    """The longest prompt that leaves room for the output (None: unknown)."""
    return max(1, max_model_len - max_tokens - 1) if max_model_len else None


def _ids(n: int, seed: int) -> list[int]:
    x = seed * 2654435761 % 2**32
    out = []
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(ID_BASE + x % ID_SPAN)
    return out


def chunks_crossed(prompt_len: int, chunk_cap: int, short_prompt_threshold: int | None = None) -> int:
    """Chunk boundaries a prompt of this length crosses when prefilled alone
    (none when the target prefills it whole)."""
    if short_prompt_threshold is not None and prompt_len <= short_prompt_threshold:
        return 0
    return max(0, (prompt_len - 1) // max(1, chunk_cap))


def required_boundaries(
    chunk_cap: int, max_model_len: int, max_tokens: int, short_prompt_threshold: int | None = None
) -> int:
    """``MIN_BOUNDARIES``, or fewer where the context cannot hold a prompt
    that long (0 max_model_len: unknown, so the full requirement)."""
    limit = context_limit(max_model_len, max_tokens)
    if limit is None:
        return MIN_BOUNDARIES
    return min(MIN_BOUNDARIES, chunks_crossed(limit, chunk_cap, short_prompt_threshold))


def prompt_errors(
    prompts: list[Prompt],
    chunk_cap: int,
    max_model_len: int,
    max_tokens: int,
    short_prompt_threshold: int | None = None,
) -> list[str]:
    """Why the operator's prompts cannot make a real gate for this target;
    empty when they can (or may: a string's token count is known only
    when a worker tokenizes it, and ``run`` checks it then)."""
    if not prompts:
        return []
    errors = []
    limit = context_limit(max_model_len, max_tokens)
    for i, p in enumerate(prompts):
        if isinstance(p, list) and limit is not None and len(p) > limit:
            errors.append(
                f"prompt #{i + 1} has {len(p)} tokens; the workers' context ({max_model_len}) "
                f"leaves room for at most {limit} with {max_tokens} output tokens."
            )
    need = required_boundaries(chunk_cap, max_model_len, max_tokens, short_prompt_threshold)
    most = max(chunks_crossed(_max_len(p), chunk_cap, short_prompt_threshold) for p in prompts)
    if most < need:
        errors.append(
            f"the prompts must cross at least {need} chunk boundaries of the target (chunk cap "
            f"{chunk_cap} tokens): the longest needs more than {need * chunk_cap} tokens"
            + (f" and more than short_prompt_threshold {short_prompt_threshold}" if short_prompt_threshold else "")
            + f", but crosses at most {most}. Give longer prompts, or none for the default set."
        )
    return errors


def _max_len(prompt: Prompt) -> int:
    """A prompt's length in tokens, or for a string the most it can have."""
    return len(prompt) if isinstance(prompt, list) else len(prompt.encode()) + 1


@dataclass(frozen=True)
class Replay:
    """One prompt run on both sides."""

    prompt_len: int
    canary: list[int]
    stable: list[int]


@dataclass(frozen=True)
class Mismatch:
    prompt_index: int
    prompt_len: int
    position: int  # first output position where the two differ
    canary_token: int | None  # None: that side ended first
    stable_token: int | None

    def describe(self) -> str:
        return (
            f"prompt #{self.prompt_index + 1} ({self.prompt_len} tokens) differs at output position "
            f"{self.position}: canary {self.canary_token}, stable {self.stable_token}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt_index,
            "prompt_len": self.prompt_len,
            "position": self.position,
            "canary_token": self.canary_token,
            "stable_token": self.stable_token,
        }


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(replays: list[Replay]) -> list[Mismatch]:
    out = []
    for i, r in enumerate(replays):
        pos = first_difference(r.canary, r.stable)
        if pos is not None:
            out.append(Mismatch(i, r.prompt_len, pos, _at(r.canary, pos), _at(r.stable, pos)))
    return out


def _at(ids: list[int], i: int) -> int | None:
    return ids[i] if i < len(ids) else None


def replay(client: httpx.Client, base_url: str, prompt: Prompt, max_tokens: int) -> tuple[list[int], list[int]]:
    """Greedy completion on one worker: (prompt token ids, output token ids)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": False,
    }
    try:
        response = client.post(base_url.rstrip("/") + "/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise GateError(f"{base_url} unreachable: {exc}") from exc
    if response.status_code != 200:
        raise GateError(f"{base_url} answered {response.status_code}: {response.text[:300]}")
    try:
        choice = response.json()["choices"][0]
        output = [int(t) for t in choice["token_ids"]]
        prompt_ids = [int(t) for t in choice.get("prompt_token_ids") or response.json().get("prompt_token_ids") or []]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise GateError(f"{base_url} did not return token ids (return_token_ids): {exc}") from exc
    return prompt_ids, output


@dataclass(frozen=True)
class GateOutcome:
    passed: bool
    message: str
    details: dict[str, Any]
    error: bool = False  # not a verdict: the replays could not show what the gate must (too few boundaries)


def run(
    canary_url: str,
    stable_url: str,
    prompts: list[Prompt],
    max_tokens: int,
    chunk_cap: int,
    timeout_seconds: float = TIMEOUT_SECONDS,
    *,
    min_boundaries: int = MIN_BOUNDARIES,
    short_prompt_threshold: int | None = None,
) -> GateOutcome:
    """Replay every prompt on both workers and compare. Raises GateError when
    a replay could not be made; an error outcome (not a pass) when no
    prompt crossed ``min_boundaries`` chunk boundaries."""
    replays: list[Replay] = []
    with httpx.Client(timeout=timeout_seconds) as client:
        for prompt in prompts:
            canary_prompt, canary_out = replay(client, canary_url, prompt, max_tokens)
            stable_prompt, stable_out = replay(client, stable_url, prompt, max_tokens)
            if canary_prompt and stable_prompt and canary_prompt != stable_prompt:
                raise GateError("the two workers tokenized a prompt differently; they serve different models")
            length = len(canary_prompt) or (len(prompt) if isinstance(prompt, list) else 0)
            replays.append(Replay(length, canary_out, stable_out))
    mismatches = compare(replays)
    crossed = max((chunks_crossed(r.prompt_len, chunk_cap, short_prompt_threshold) for r in replays), default=0)
    details = {
        "canary_url": canary_url,
        "stable_url": stable_url,
        "chunk_cap": chunk_cap,
        "max_tokens": max_tokens,
        "prompt_lengths": [r.prompt_len for r in replays],
        "max_chunk_boundaries_crossed": crossed,
        "min_chunk_boundaries": min_boundaries,
        "mismatches": [m.to_json() for m in mismatches],
    }
    if mismatches:
        return GateOutcome(False, mismatches[0].describe(), details)
    lengths = ", ".join(str(r.prompt_len) for r in replays)
    if crossed < min_boundaries:
        return GateOutcome(
            False,
            f"the prompts ({lengths} tokens) crossed at most {crossed} chunk boundaries of "
            f"{chunk_cap} tokens, fewer than the {min_boundaries} needed: identical output "
            "proves nothing about chunking; give longer prompts",
            details,
            error=True,
        )
    return GateOutcome(
        True,
        f"{len(replays)} prompts ({lengths} tokens, up to {crossed} chunk boundaries) identical token for token",
        details,
    )
