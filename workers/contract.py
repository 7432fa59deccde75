"""The agent ⇄ control plane contract: the JSON both sides speak, in one place.

The worker agent (workers/agent) sends these; the control plane
(controlplane/fleet) parses them with the same functions, so a field renamed
here breaks both sides' tests at once. Pure Python, no Django.

    POST {control_plane}/api/v1/agent/register/
        body RegisterRequest  → 201 RegisterReply
        401 for an unknown, used-up or expired enrollment token
    POST {control_plane}/api/v1/agent/heartbeat/
        header  Authorization: Bearer <worker secret>
        body HeartbeatRequest → 200 HeartbeatReply
        401 for an unknown secret

The heartbeat reply carries the desired profile revision in full, so an agent
applies it without another call. ``drain`` asks the worker to stop admitting
(operator action); the agent then reports ``draining``.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from workers.profile import ENGINE_KINDS

CONTRACT_VERSION = 1

MAX_URL_LENGTH = 300  # the control plane's Worker.url

REGISTER_PATH = "/api/v1/agent/register/"
HEARTBEAT_PATH = "/api/v1/agent/heartbeat/"

# States an agent reports; "unhealthy" comes with ``health_error`` (its
# engine stopped serving). The control plane adds its own: unhealthy and
# offline (missed heartbeats) and registering (enrolled, no heartbeat yet).
AgentState = Literal["ready", "draining", "applying", "loading", "unhealthy"]
AGENT_STATES: tuple[str, ...] = ("ready", "draining", "applying", "loading", "unhealthy")


class ContractError(ValueError):
    """A payload that does not follow the contract; ``errors`` maps field → reasons."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


class Hardware(TypedDict, total=False):
    device: str  # "cuda" or "cpu"
    name: str  # e.g. "NVIDIA H200" or the CPU model
    num_devices: int
    memory_bytes: int  # per device; host memory on CPU
    cpu_count: int
    simulated: bool  # a simulated engine's device (engine kind "sim"); absent or false on real hardware
    # What a simulated device rests on (workers.engines.sim.steptime Device.describe()): for
    # AIConfigurator, kind "aiconfigurator", system, backend, database_version, model; for a
    # fitted table, kind "fitted", table, model_dir. Predictions rebuild the same device from it.
    sim: dict[str, Any]


class Load(TypedDict, total=False):
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # 0–1, as vLLM reports it


class ProfileRef(TypedDict):
    revision_id: int
    name: str
    revision: int
    fields: dict[str, Any]  # EngineProfile.to_dict()


class RegisterRequest(TypedDict):
    contract_version: int
    enroll_token: str
    name: str
    url: str  # where the worker's OpenAI server listens
    engine_kind: str
    model: str
    max_model_len: int
    hardware: Hardware
    labels: dict[str, str]


class RegisterReply(TypedDict):
    worker_id: int
    secret: str
    heartbeat_interval_seconds: float


class HeartbeatRequest(TypedDict):
    contract_version: int
    state: str
    load: Load
    running_revision_id: int | None  # None: the profile given on the command line
    running_profile: dict[str, Any]  # what the engine runs now, in full
    hardware: Hardware
    apply_error: str | None  # why the last apply failed, if it did
    url: str | None  # where the worker listens now (it may have restarted on another port); None: unchanged
    health_error: str | None  # why the engine cannot serve (state "unhealthy")


class HeartbeatReply(TypedDict):
    worker_id: int
    desired: ProfileRef | None
    drain: bool
    heartbeat_interval_seconds: float


def _require(data: Any, spec: dict[str, tuple[type | tuple[type, ...], bool]]) -> dict[str, list[str]]:
    """Type-check ``data`` against {field: (types, required)}."""
    if not isinstance(data, dict):
        return {"non_field_errors": ["expected a JSON object."]}
    errors: dict[str, list[str]] = {}
    for name, (types, required) in spec.items():
        if name not in data:
            if required:
                errors[name] = ["this field is required."]
            continue
        value = data[name]
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            errors[name] = ["has the wrong type."]
        elif not isinstance(value, types):
            errors[name] = ["has the wrong type."]
    return errors


def parse_register(data: Any) -> RegisterRequest:
    errors = _require(
        data,
        {
            "contract_version": (int, True),
            "enroll_token": (str, True),
            "name": (str, True),
            "url": (str, True),
            "engine_kind": (str, True),
            "model": (str, False),
            "max_model_len": (int, False),
            "hardware": (dict, False),
            "labels": (dict, False),
        },
    )
    if not errors:
        if data["contract_version"] != CONTRACT_VERSION:
            errors["contract_version"] = [f"this control plane speaks version {CONTRACT_VERSION}."]
        if data["engine_kind"] not in ENGINE_KINDS:
            errors["engine_kind"] = [f"must be one of {', '.join(ENGINE_KINDS)}."]
        if not data["name"].strip():
            errors["name"] = ["must not be empty."]
        if not data["url"].startswith(("http://", "https://")):
            errors["url"] = ["must be an http(s) URL."]
    if errors:
        raise ContractError(errors)
    return RegisterRequest(
        contract_version=data["contract_version"],
        enroll_token=data["enroll_token"],
        name=data["name"].strip(),
        url=data["url"].rstrip("/"),
        engine_kind=data["engine_kind"],
        model=data.get("model", ""),
        max_model_len=data.get("max_model_len", 0),
        hardware=data.get("hardware", {}),
        labels={str(k): str(v) for k, v in data.get("labels", {}).items()},
    )


def parse_heartbeat(data: Any) -> HeartbeatRequest:
    errors = _require(
        data,
        {
            "contract_version": (int, True),
            "state": (str, True),
            "load": (dict, False),
            "running_revision_id": ((int, type(None)), False),
            "running_profile": (dict, False),
            "hardware": (dict, False),
            "apply_error": ((str, type(None)), False),
            "url": ((str, type(None)), False),
            "health_error": ((str, type(None)), False),
        },
    )
    if not errors and data["state"] not in AGENT_STATES:
        errors["state"] = [f"must be one of {', '.join(AGENT_STATES)}."]
    url = data.get("url") if not errors else None
    if url is not None and (not url.startswith(("http://", "https://")) or len(url) > MAX_URL_LENGTH):
        errors["url"] = [f"must be an http(s) URL of at most {MAX_URL_LENGTH} characters."]
    if errors:
        raise ContractError(errors)
    return HeartbeatRequest(
        contract_version=data["contract_version"],
        state=data["state"],
        load=data.get("load", {}),
        running_revision_id=data.get("running_revision_id"),
        running_profile=data.get("running_profile", {}),
        hardware=data.get("hardware", {}),
        apply_error=data.get("apply_error"),
        url=url.rstrip("/") if url else None,
        health_error=data.get("health_error"),
    )
