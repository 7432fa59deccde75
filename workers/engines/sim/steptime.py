"""What one engine step costs on the simulated device, and what it holds.

A step is the scheduler's batch: prefill chunks (each ``n`` new tokens after
``start`` cached or earlier-chunk tokens) and decodes (one token each over
its KV length). ``StepBatch.of`` reads that from the reference scheduler's
chunks, and a ``Device`` prices it in seconds and says how much memory the
simulated GPU has for weights and KV.

Two devices:

- ``AicDevice``: NVIDIA AIConfigurator's measured kernel database
  (``aiconfigurator-core``) for a system (``h200_sxm``), a backend (``vllm``)
  and a model config (``meta-llama/Meta-Llama-3.1-8B``). A step is priced as
  the package prices one mixed step, from its three parts::

      shared GEMMs, norms, comms (context tokens, decode count)
    + context attention, per prefill chunk (its tokens over its context)
    + decode attention (decode count over their mean KV length)

  and KV capacity is the package's own estimate at a memory fraction.
- ``FittedDevice``: a linear step-time model fitted to the reference engine's
  own step records (``workers.engines.sim.fit``), for the tiny model on this CPU.
  It is how a prediction for a reference worker is checked against what the
  reference worker then does.

Unknown names fail with ``SimSetupError``, whose message names the field and
lists what is available: a simulation never falls back to another GPU's data.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from workers.engines.reference.config import ModelConfig
from workers.engines.reference.memory import StepShape, transient_bytes

log = logging.getLogger(__name__)

# vLLM's default gpu_memory_utilization: the share of the device an engine takes.
DEFAULT_MEMORY_FRACTION = 0.9
KV_ELEM_BYTES = 2  # bf16 / fp16 KV cache, as the database's vLLM runs


class SimSetupError(ValueError):
    """A simulation that cannot be set up; ``field`` names the option at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class StepBatch:
    """One step's work: ``prefills`` as (start, new tokens); decodes' KV lengths."""

    prefills: tuple[tuple[int, int], ...] = ()
    decode_kv_lens: tuple[int, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_kv_lens)

    @property
    def prefill_attention(self) -> float:
        """Token-pairs of causal attention over the chunks: n·(start + n/2) each."""
        return float(sum(n * (s + n / 2) for s, n in self.prefills))

    @classmethod
    def of(cls, chunks: Any) -> StepBatch:
        """From the reference scheduler's ``ScheduledChunk`` list."""
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for c in chunks:
            if c.is_decode:
                decodes.append(c.start + 1)
            else:
                prefills.append((c.start, c.num_tokens))
        return cls(tuple(prefills), tuple(decodes))


class Device(Protocol):
    """A simulated device running one model."""

    name: str  # shown as the worker's hardware, always with "(simulated)"
    memory_bytes: int  # the device's memory
    weight_bytes: int
    model_config: ModelConfig  # sizes the KV blocks and a step's transient memory
    elem_bytes: int

    def step_seconds(self, batch: StepBatch) -> float: ...

    def kv_cache_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """KV cache an engine gets by default for this profile's batch shape."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the simulation rests on, for /health, the agent and README."""
        ...


# ---- AIConfigurator --------------------------------------------------------------
def _package() -> Any:
    # Imported when a simulated device is built: a reference or vLLM worker
    # never pays for the kernel database (pandas, pyarrow, the Rust core).
    # Loading a database warns about every low-fidelity table it holds (MLA,
    # sparse attention: other model families' kernels), six lines per load in
    # every worker's and Celery's log; errors still show.
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    try:
        import aiconfigurator_core.sdk as sdk
    except ImportError as exc:  # pragma: no cover - it is a dependency
        raise SimSetupError("sim", f"aiconfigurator-core is not installed ({exc}).") from exc
    return sdk


@functools.cache
def supported_databases() -> dict[str, dict[str, list[str]]]:
    """system → backend → database versions, as the package ships them."""
    from aiconfigurator_core.sdk.perf_database import get_supported_databases  # lazy: see _package

    _package()
    return {s: {b: list(v) for b, v in backends.items()} for s, backends in get_supported_databases().items()}


def _model_configs_dir() -> Path:
    import aiconfigurator_core  # lazy: see _package

    return Path(aiconfigurator_core.__file__).parent / "model_configs"


@functools.cache
def packaged_models() -> tuple[str, ...]:
    """Model ids whose config the package ships (``org/name``)."""
    names = []
    for path in _model_configs_dir().glob("*_config.json"):
        stem = path.name[: -len("_config.json")]
        if stem.endswith("_hf_quant"):
            continue
        names.append(stem.replace("--", "/", 1))
    return tuple(sorted(names))


def _model_config_path(model: str) -> Path:
    local = Path(model)
    if local.is_dir() and (local / "config.json").exists():
        return local / "config.json"
    if local.suffix == ".json" and local.exists():
        return local
    packaged = _model_configs_dir() / f"{model.replace('/', '--', 1)}_config.json"
    if packaged.exists():
        return packaged
    raise SimSetupError(
        "sim_model",
        f"{model!r} is neither a local config.json nor a model the database knows; "
        f"known: {', '.join(packaged_models())}.",
    )


def pretty_system(system: str) -> str:
    """``h200_sxm`` → ``H200 SXM``, ``a100_pcie`` → ``A100 PCIe``."""
    return " ".join("PCIe" if part == "pcie" else part.upper() for part in system.split("_"))


class AicDevice:
    """A GPU from AIConfigurator's database, running one model on one GPU (TP 1)."""

    elem_bytes = KV_ELEM_BYTES

    def __init__(self, system: str, backend: str, model: str, version: str | None = None):
        databases = supported_databases()
        if system not in databases:
            raise SimSetupError("sim_system", f"unknown system {system!r}; available: {', '.join(sorted(databases))}.")
        if backend not in databases[system]:
            raise SimSetupError(
                "sim_backend",
                f"{system} has no {backend!r} database; available: {', '.join(sorted(databases[system]))}.",
            )
        versions = databases[system][backend]
        if version is None:
            from aiconfigurator_core.sdk.perf_database import get_latest_database_version  # lazy: see _package

            version = str(get_latest_database_version(system, backend))
        if version not in versions:
            raise SimSetupError(
                "sim_version", f"{system}/{backend} has no database {version!r}; available: {', '.join(versions)}."
            )
        config_path = _model_config_path(model)
        model_ref = model if not Path(model).exists() else str(config_path.parent)
        self.system, self.backend, self.version, self.model = system, backend, version, model
        raw = json.loads(config_path.read_text())
        try:
            self.model_config = ModelConfig.from_dict(raw)
        except ValueError as exc:
            raise SimSetupError("sim_model", f"{model!r}: {exc}") from exc
        sdk = _package()
        try:
            self._engine = sdk.EngineHandle.compile(model_ref, system, backend, backend_version=version)
            memory = sdk.estimate_kv_cache(
                model_ref,
                system,
                backend,
                version,
                max_num_tokens=8192,
                max_batch_size=256,
                memory_fraction_kind="of_total",
                memory_fraction_value=DEFAULT_MEMORY_FRACTION,
            )
        except (ValueError, KeyError, RuntimeError) as exc:
            raise SimSetupError(
                "sim_model", f"the database cannot model {model!r} on {system}/{backend}: {exc}"
            ) from exc
        breakdown = memory["memory_breakdown"]
        self.memory_bytes = int(memory["total_gpu_capacity_bytes"])
        self.weight_bytes = int(breakdown["weights_bytes"])
        self._reserved_bytes = int(breakdown["runtime_overhead_bytes"]) + int(breakdown["comm_overhead_bytes"])
        self.kv_bytes_per_token = int(memory["kv_size_per_token_bytes"])
        self.name = f"{pretty_system(system)} (simulated)"
        self._cached = functools.lru_cache(maxsize=65536)(self._parts)
        try:  # the database may lack a kernel this model needs (a head size, a quantisation): say so now
            self.step_seconds(StepBatch(prefills=((0, 64),), decode_kv_lens=(64,)))
            self.step_seconds(StepBatch(decode_kv_lens=(64,)))
        except Exception as exc:  # the package's error types vary; any failure here is this one
            raise SimSetupError(
                "sim_model", f"the {system}/{backend} {version} database cannot price {model!r}: {exc}"
            ) from exc

    # one mixed step = shared (tokens, decodes) + context attention + decode attention
    def _parts(self, kind: str, a: int, b: int) -> float:
        e = self._engine
        if kind == "shared":  # a: context tokens, b: decodes
            return float(e.mixed_step_breakdown(a, b, max(a, 1), 2)[1])
        if kind == "context":  # a: new tokens, b: start (prefix)
            return float(e.mixed_step_breakdown(a, 0, a + b, 2, b)[2])
        if kind == "decode_only":  # a: decodes, b: mean KV length
            return float(e.decode_step_latency(a, b, 2))
        # decode attention inside a mixed step: a decodes over KV length b
        return float(e.mixed_step_breakdown(1, a, b, 2)[3])

    def step_seconds(self, batch: StepBatch) -> float:
        decodes = batch.num_decodes
        mean_kv = _round_up(round(sum(batch.decode_kv_lens) / decodes), 16) if decodes else 0
        if not batch.prefills:
            return self._cached("decode_only", decodes, mean_kv) / 1e3 if decodes else 0.0
        ms = self._cached("shared", batch.prefill_tokens, decodes)
        for start, n in batch.prefills:
            ms += self._cached("context", n, _round_up(start, 16))
        if decodes:
            ms += self._cached("decode", decodes, mean_kv)
        return ms / 1e3

    def kv_cache_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        usable = int(self.memory_bytes * DEFAULT_MEMORY_FRACTION) - self.weight_bytes - self._reserved_bytes
        return max(0, usable - self.activation_bytes(max_num_batched_tokens, max_num_seqs))

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        shape = StepShape(
            num_tokens=max_num_batched_tokens, num_sampled=max_num_seqs, num_prefill_tokens=max_num_batched_tokens
        )
        return transient_bytes(self.model_config, shape, self.elem_bytes)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "aiconfigurator",
            "system": self.system,
            "backend": self.backend,
            "database_version": self.version,
            "model": self.model,
            "memory_bytes": self.memory_bytes,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple if value > 0 else 0


# ---- fitted to the reference engine ------------------------------------------------
FIT_FEATURES = ("steps", "prefill_tokens", "decodes", "prefill_attention", "decode_kv_tokens")


def features(batch: StepBatch) -> tuple[float, ...]:
    """The fitted model's inputs for one step, in ``FIT_FEATURES`` order."""
    return (
        1.0,
        float(batch.prefill_tokens),
        float(batch.num_decodes),
        batch.prefill_attention,
        float(sum(batch.decode_kv_lens)),
    )


class FittedDevice:
    """The reference engine's own cost on this machine, fitted from its steps.

    ``table`` is the JSON ``workers.engines.sim.fit`` writes: the coefficient
    of each of ``FIT_FEATURES`` (seconds per unit), one set for decode-only
    steps and one for steps with a prefill, the model directory it was fitted
    on, and how well it fitted. Memory is the reference engine's own
    accounting for that model on CPU.
    """

    elem_bytes = 4  # the reference engine runs float32 on CPU

    def __init__(self, table: str | Path):
        path = Path(table)
        try:
            data = json.loads(path.read_text())
            sets = data["coefficients"]
            self.decode = tuple(float(sets["decode"][name]) for name in FIT_FEATURES)
            self.prefill = tuple(float(sets["prefill"][name]) for name in FIT_FEATURES)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SimSetupError("sim_table", f"{table} is not a fitted step-time table: {exc!r}") from exc
        if not all(math.isfinite(c) for c in self.decode + self.prefill):
            raise SimSetupError("sim_table", f"{table} holds a coefficient that is not finite.")
        self.table = data
        self.path = path
        model_dir = Path(data.get("model_dir", ""))
        if not (model_dir / "config.json").exists():
            raise SimSetupError("sim_table", f"{table} was fitted on {model_dir}, which is not a checkpoint here.")
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.weight_bytes = int(data.get("weight_bytes", 0))
        self.memory_bytes = int(data.get("memory_bytes", 0))
        self.name = f"{data.get('hardware', 'CPU')} (simulated, fitted)"

    def step_seconds(self, batch: StepBatch) -> float:
        coefficients = self.prefill if batch.prefills else self.decode
        return max(0.0, sum(c * x for c, x in zip(coefficients, features(batch), strict=True)))

    def kv_cache_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        return int(self.table.get("kv_cache_bytes", 256 << 20))

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "fitted",
            "table": str(self.path),
            "model_dir": self.table.get("model_dir"),
            "fitted_on": self.table.get("fitted_on"),
            "r2": self.table.get("r2"),
        }


def load_device(
    *,
    system: str | None = None,
    backend: str = "vllm",
    model: str | None = None,
    version: str | None = None,
    table: str | None = None,
) -> Device:
    """The device named by a worker's ``--sim-*`` options."""
    if table:
        return FittedDevice(table)
    if not system:
        raise SimSetupError(
            "sim_system", f"is required (or sim_table); available: {', '.join(sorted(supported_databases()))}."
        )
    if not model:
        raise SimSetupError("sim_model", f"is required; known: {', '.join(packaged_models())}.")
    return AicDevice(system, backend, model, version)


def from_description(described: dict[str, Any]) -> Device:
    """The device a simulated worker reported (``Device.describe()``, in its
    hardware's ``sim``): how a prediction simulates that worker's own GPU."""
    kind = described.get("kind")
    if kind == "aiconfigurator":
        return AicDevice(
            str(described["system"]),
            str(described["backend"]),
            str(described["model"]),
            described.get("database_version"),
        )
    if kind == "fitted":
        return FittedDevice(str(described["table"]))
    raise SimSetupError("sim", f"an unknown simulated device kind {kind!r}.")


__all__ = [
    "from_description",
    "FIT_FEATURES",
    "AicDevice",
    "Device",
    "FittedDevice",
    "SimSetupError",
    "StepBatch",
    "features",
    "load_device",
    "packaged_models",
    "supported_databases",
]
