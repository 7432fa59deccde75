"""``python -m workers serve``: one engine behind the OpenAI API, with the agent.

The HTTP server comes up at once and answers /health with 503 while the
engine loads, so an orchestrator sees a live process that is not ready yet.
With ``--control-plane`` the agent registers (``--enroll-token``), heartbeats
and applies the profiles it is given; without it the worker serves the
profile of ``--profile`` until stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn

from workers import engines
from workers.agent import Agent, ControlPlaneClient, detect_hardware
from workers.contract import Hardware
from workers.engines.api import EngineSpec
from workers.profile import ENGINE_KINDS, ProfileError, load_profile
from workers.server.app import build_app, max_request_bytes_for
from workers.server.host import EngineHost, RunningProfile
from workers.server.metrics import MetricsExporter
from workers.server.wire import JsonErrorsHttpTools

log = logging.getLogger("workers.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=ENGINE_KINDS, default="reference", help="engine backend (default: reference)"
    )
    parser.add_argument(
        "--model",
        help="local Hugging Face checkpoint directory (sim: the tokenizer's; default: the shipped tiny model)",
    )
    parser.add_argument("--profile", help="engine profile: a JSON object or a JSON file path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients send (default: the directory's name)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--max-model-len", type=int, help="cap the context length below the checkpoint's")
    parser.add_argument("--dtype", default="auto", help="vLLM only: weight and activation dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-queue", type=int, default=128, help="requests that may wait beyond max_num_seqs before 429"
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        help="largest request body accepted, else 413 (default: 64 bytes per token of context, at least 8 MiB)",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=60.0, help="seconds in-flight requests get to finish on a profile switch"
    )
    cp = parser.add_argument_group("control plane")
    cp.add_argument("--control-plane", help="control plane base URL; enables the agent")
    cp.add_argument("--enroll-token", help="enrollment token for the first registration")
    cp.add_argument("--name", default=socket.gethostname(), help="worker name (default: host name)")
    cp.add_argument("--advertise-url", help="URL the control plane and gateway reach this worker at")
    cp.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="worker label (repeatable)")
    cp.add_argument("--state-file", type=Path, help="where the agent keeps its worker secret across restarts")
    parser.add_argument(
        "--fault-stall-marker",
        default="",
        help="fault injection (reference engine, off by default): a request whose prompt contains this text "
        "stops being fed after its first output",
    )
    sim = parser.add_argument_group("simulated engine (--engine sim)")
    sim.add_argument("--sim-system", help="GPU system in AIConfigurator's database, e.g. h200_sxm")
    sim.add_argument(
        "--sim-backend", default="vllm", help="serving backend whose kernels were measured (default: vllm)"
    )
    sim.add_argument(
        "--sim-model",
        help="model config: an id the database ships (meta-llama/Meta-Llama-3.1-8B) or a local config.json",
    )
    sim.add_argument("--sim-version", help="database version (default: the newest for the system and backend)")
    sim.add_argument("--sim-table", help="instead of a GPU: a step-time table fitted to the reference engine (JSON)")
    sim.add_argument(
        "--count",
        type=int,
        default=1,
        help="sim only: serve this many workers from one process, on ports PORT..PORT+COUNT-1, named NAME-0..",
    )
    parser.add_argument("--log-level", default="info")


def _checkpoint_max_len(model: str, cap: int | None) -> int | None:
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return cap
    native = config.get("max_position_embeddings")
    if native is None:
        return cap
    return min(int(native), cap) if cap else int(native)


def _advertise_url(args: argparse.Namespace, port: int) -> str:
    if args.advertise_url and args.count == 1:
        return str(args.advertise_url).rstrip("/")
    host = args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


def _sim_device(spec: EngineSpec, cap: int | None) -> tuple[Hardware, int]:
    """A simulated worker's hardware report and max length, from its device."""
    from workers.engines.sim.backend import spec_device  # only a simulated worker loads the kernel database

    device = spec_device(spec)
    hardware = Hardware(
        device="sim",
        name=device.name,
        num_devices=1,
        memory_bytes=device.memory_bytes,
        cpu_count=os.cpu_count() or 1,
        simulated=True,
        sim=device.describe(),
    )
    native = device.model_config.max_position_embeddings
    return hardware, min(native, cap) if cap else native


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if args.count < 1 or (args.count > 1 and args.engine != "sim"):
        print("error: --count: must be 1, or more with --engine sim.", file=sys.stderr)
        return 2
    if args.model is None:
        if args.engine != "sim":
            print("error: --model is required.", file=sys.stderr)
            return 2
        from workers.engines.reference.tiny import SHIPPED_DIR  # the tokenizer a simulated worker speaks

        args.model = str(SHIPPED_DIR)
    spec = EngineSpec(
        kind=args.engine,
        model=args.model,
        device=args.device,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        seed=args.seed,
        fault_stall_marker=args.fault_stall_marker,
        sim_system=args.sim_system,
        sim_backend=args.sim_backend,
        sim_model=args.sim_model,
        sim_version=args.sim_version,
        sim_table=args.sim_table,
    )
    if not (Path(args.model) / "config.json").exists():
        print(f"error: {args.model} is not a checkpoint directory (no config.json).", file=sys.stderr)
        return 2
    hardware: Hardware | None = None
    try:
        if args.engine == "sim":
            # A simulated device that cannot be built ends here, naming the option
            # and what is available: never a silent fall-back to other data.
            hardware, sim_max_len = _sim_device(spec, args.max_model_len)
            max_model_len: int | None = sim_max_len
            spec = dataclasses.replace(spec, max_model_len=max_model_len)
        else:
            max_model_len = _checkpoint_max_len(args.model, args.max_model_len)
    except ValueError as exc:
        print(f"error: --{str(getattr(exc, 'field', 'sim')).replace('_', '-')}: {exc}", file=sys.stderr)
        return 2
    backend = engines.backend(args.engine)
    try:
        # The contract's rules first: a knob the engine lacks is refused
        # before torch (let alone vLLM) is imported.
        given = (
            load_profile(args.profile, engine_kind=args.engine, max_model_len=max_model_len) if args.profile else None
        )
        device = engines.resolve_device(args.device) if args.engine != "sim" else "sim"
        profile = given or backend.default_profile(device)
        engines.validate(spec, profile, max_model_len)
    except ProfileError as exc:
        print(f"error: the profile cannot run on the {args.engine} engine: {exc}", file=sys.stderr)
        return 2
    if hardware is None:
        hardware = detect_hardware(device)
    configs = [_worker_config(args, i, spec, backend, profile, max_model_len, hardware) for i in range(args.count)]
    if len(configs) == 1:
        uvicorn.Server(configs[0]).run()
        return 0

    async def serve_all() -> None:
        servers = [uvicorn.Server(c) for c in configs]
        await asyncio.gather(*(server.serve() for server in servers))

    asyncio.run(serve_all())
    return 0


def _worker_config(
    args: argparse.Namespace,
    index: int,
    spec: EngineSpec,
    backend: Any,
    profile: Any,
    max_model_len: int | None,
    hardware: Hardware,
) -> uvicorn.Config:
    """One worker: engine host, agent and OpenAI app on its own port.
    With ``--count N`` (simulated), worker ``i`` listens on PORT+i and is NAME-i."""
    many = args.count > 1
    port = args.port + index
    name = f"{args.name}-{index}" if many else args.name
    exporter = MetricsExporter(model_name=spec.model_name, max_model_len=max_model_len or 32768)

    def on_engine(engine: Any, running: RunningProfile) -> None:
        exporter.attach(engine)
        exporter.set_profile(
            running.profile,
            engine_kind=args.engine,
            name=running.name,
            revision=running.revision if running.revision is not None else 0,
        )

    host = EngineHost(
        lambda p: backend.build(spec, p),
        RunningProfile(profile),
        validate=lambda p, mll: engines.validate(spec, p, mll),
        max_queue=args.max_queue,
        drain_timeout_seconds=args.drain_timeout,
        on_engine=on_engine,
    )
    agent = None
    if args.control_plane:
        labels = dict(item.split("=", 1) for item in args.label if "=" in item)
        state_file = args.state_file
        if state_file is not None and many:
            state_file = state_file.with_name(f"{state_file.stem}-{index}{state_file.suffix}")
        agent = Agent(
            host,
            ControlPlaneClient(args.control_plane),
            enroll_token=args.enroll_token,
            name=name,
            url=_advertise_url(args, port),
            engine_kind=args.engine,
            model=spec.model_name,
            max_model_len=max_model_len or 0,
            hardware=hardware,
            labels=labels,
            state_file=state_file,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async def start_engine() -> None:
            try:
                await host.start()
                log.info(
                    "ready: %s engine, model %s, profile %s",
                    args.engine,
                    spec.model_name,
                    host.running.profile.to_json(),
                )
            except Exception:
                log.exception("the engine failed to start")

        tasks = [asyncio.ensure_future(start_engine())]
        if agent is not None:
            tasks.append(asyncio.ensure_future(agent.run()))
        try:
            yield
        finally:
            if agent is not None:
                agent.stop()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            await host.shutdown()
            if agent is not None:
                await agent.client.close()

    app = build_app(
        host,
        exporter,
        model_name=spec.model_name,
        model_aliases=(args.model, str(Path(args.model).resolve())),
        lifespan=lifespan,
        max_request_bytes=args.max_request_bytes or max_request_bytes_for(max_model_len),
    )
    app.state.agent = agent
    return uvicorn.Config(
        app,
        host=args.host,
        port=port,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=max(5, int(args.drain_timeout)),
        http=JsonErrorsHttpTools,  # the 400s uvicorn answers itself in JSON too
    )


__all__ = ["add_arguments", "main"]
