"""Engine profiles: the knobs of the engine contract and their rules
("Engine contract" in docs/architecture.md; docs/engines.md for what each
engine does with them).

One definition serves the engine (which refuses a bad profile), the worker
agent (which applies one) and the control plane (which validates an edit and
shows field-level errors). Pure Python: no Django, no torch.

Names follow vLLM where vLLM has the knob. ``short_prompt_threshold`` and
``min_prefill_tokens_per_step`` are Chunkpilot's own; the vLLM backend refuses
them (``None`` means "not set").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PrefillMode = Literal["chunked", "monolithic"]
EngineKind = Literal["reference", "vllm", "sim"]
PREFILL_MODES: tuple[str, ...] = ("chunked", "monolithic")
ENGINE_KINDS: tuple[str, ...] = ("reference", "vllm", "sim")

# Knobs an engine kind lacks; setting one for that kind is an error.
UNSUPPORTED_KNOBS: dict[str, frozenset[str]] = {
    "reference": frozenset(),
    "sim": frozenset(),  # the reference engine's scheduler, so its knobs
    "vllm": frozenset({"short_prompt_threshold", "min_prefill_tokens_per_step"}),
}


class ProfileError(ValueError):
    """A profile that breaks the engine contract; ``errors`` maps field → reasons."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{name}: {' '.join(msgs)}" for name, msgs in errors.items()))


@dataclass(frozen=True)
class EngineProfile:
    prefill_mode: PrefillMode = "chunked"
    # Token budget of one step: decode tokens plus prefill-chunk tokens.
    max_num_batched_tokens: int = 512
    # The most prompt tokens one request may prefill in one step (chunk cap);
    # None: the whole budget.
    long_prefill_token_threshold: int | None = None
    # Prompts at or below this many tokens are prefilled whole, never split.
    short_prompt_threshold: int | None = None
    # While a prefill waits, at least this many prefill tokens run each step.
    min_prefill_tokens_per_step: int | None = None
    max_num_seqs: int = 64
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV cache size; None: the engine's default for its device.
    kv_cache_bytes: int | None = None

    # ---- derived --------------------------------------------------------
    @property
    def chunk_cap(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    @property
    def is_chunked(self) -> bool:
        return self.prefill_mode == "chunked"

    def set_fields(self) -> dict[str, Any]:
        """Only the knobs that differ from the defaults: what an edit changed."""
        default = EngineProfile()
        return {k: v for k, v in self.to_dict().items() if getattr(default, k) != v}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        *,
        engine_kind: str = "reference",
        max_model_len: int | None = None,
    ) -> EngineProfile:
        """Build and validate; raises ProfileError naming every bad field."""
        errors = profile_errors(data, engine_kind=engine_kind, max_model_len=max_model_len)
        if errors:
            raise ProfileError(errors)
        known = set(cls.field_names())
        return cls(**{k: v for k, v in data.items() if k in known})

    def validate(self, *, engine_kind: str = "reference", max_model_len: int | None = None) -> None:
        errors = profile_errors(self.to_dict(), engine_kind=engine_kind, max_model_len=max_model_len)
        if errors:
            raise ProfileError(errors)


_INT_FIELDS = (
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "short_prompt_threshold",
    "min_prefill_tokens_per_step",
    "max_num_seqs",
    "block_size",
    "kv_cache_bytes",
)
_OPTIONAL = {f.name for f in dataclasses.fields(EngineProfile) if f.default is None}


def profile_errors(
    data: dict[str, Any],
    *,
    engine_kind: str = "reference",
    max_model_len: int | None = None,
) -> dict[str, list[str]]:
    """Every way ``data`` breaks the engine contract, by field; empty when fine.

    ``data`` may be partial: missing fields take their defaults.
    """
    errors: dict[str, list[str]] = {}

    def add(name: str, message: str) -> None:
        errors.setdefault(name, []).append(message)

    known = set(EngineProfile.field_names())
    for name in sorted(set(data) - known):
        add(name, f"unknown profile field; known fields: {', '.join(sorted(known))}.")
    if engine_kind not in ENGINE_KINDS:
        add("engine_kind", f"must be one of {', '.join(ENGINE_KINDS)}.")
        engine_kind = "reference"

    values = {**EngineProfile().to_dict(), **{k: v for k, v in data.items() if k in known}}

    if values["prefill_mode"] not in PREFILL_MODES:
        add("prefill_mode", f"must be one of {', '.join(PREFILL_MODES)}.")
    if not isinstance(values["enable_prefix_caching"], bool):
        add("enable_prefix_caching", "must be true or false.")
    for name in _INT_FIELDS:
        value = values[name]
        if value is None and name in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            add(name, "must be an integer.")
        elif value <= 0:
            add(name, f"must be positive; got {value}.")
    if errors.keys() & set(_INT_FIELDS):
        return errors  # the cross-field rules below need sound numbers

    budget = values["max_num_batched_tokens"]
    if budget < values["max_num_seqs"]:
        add(
            "max_num_batched_tokens",
            f"the step budget ({budget}) is below max_num_seqs ({values['max_num_seqs']}): "
            "a step could not give every running request its decode token.",
        )
    for name in ("long_prefill_token_threshold", "short_prompt_threshold", "min_prefill_tokens_per_step"):
        value = values[name]
        if value is not None and value > budget:
            add(name, f"{value} is above the step budget max_num_batched_tokens ({budget}).")
    if values["prefill_mode"] == "monolithic" and max_model_len is not None and budget < max_model_len:
        add(
            "max_num_batched_tokens",
            f"monolithic prefill runs a whole prompt in one step, so the budget ({budget}) "
            f"must be at least the model's max length ({max_model_len}).",
        )
    if values["block_size"] & (values["block_size"] - 1):
        add("block_size", f"must be a power of two; got {values['block_size']}.")

    for name in sorted(UNSUPPORTED_KNOBS[engine_kind]):
        if values.get(name) is not None:
            add(name, f"the {engine_kind} engine has no such knob; leave it unset for {engine_kind} workers.")
    return errors


def load_profile(
    source: str | None, *, engine_kind: str = "reference", max_model_len: int | None = None
) -> EngineProfile:
    """A profile from a JSON string or a JSON file path (the CLI's --profile)."""
    if not source:
        return EngineProfile()
    text = source
    if not source.lstrip().startswith("{"):
        text = Path(source).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError({"profile": [f"not valid JSON: {exc}"]}) from exc
    if not isinstance(data, dict):
        raise ProfileError({"profile": ["must be a JSON object of profile fields."]})
    return EngineProfile.from_dict(data, engine_kind=engine_kind, max_model_len=max_model_len)


__all__ = [
    "EngineProfile",
    "ProfileError",
    "profile_errors",
    "load_profile",
    "PREFILL_MODES",
    "ENGINE_KINDS",
    "UNSUPPORTED_KNOBS",
]
