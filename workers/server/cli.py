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
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn

from workers import engines
from workers.agent import Agent, ControlPlaneClient, detect_hardware
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
    parser.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
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


def _advertise_url(args: argparse.Namespace) -> str:
    if args.advertise_url:
        return str(args.advertise_url).rstrip("/")
    host = args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{args.port}"


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    spec = EngineSpec(
        kind=args.engine,
        model=args.model,
        device=args.device,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        seed=args.seed,
        fault_stall_marker=args.fault_stall_marker,
    )
    if not (Path(args.model) / "config.json").exists():
        print(f"error: {args.model} is not a checkpoint directory (no config.json).", file=sys.stderr)
        return 2
    backend = engines.backend(args.engine)
    max_model_len = _checkpoint_max_len(args.model, args.max_model_len)
    try:
        # The contract's rules first: a knob the engine lacks is refused
        # before torch (let alone vLLM) is imported.
        given = (
            load_profile(args.profile, engine_kind=args.engine, max_model_len=max_model_len) if args.profile else None
        )
        device = engines.resolve_device(args.device)
        profile = given or backend.default_profile(device)
        engines.validate(spec, profile, max_model_len)
    except ProfileError as exc:
        print(f"error: the profile cannot run on the {args.engine} engine: {exc}", file=sys.stderr)
        return 2

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
        agent = Agent(
            host,
            ControlPlaneClient(args.control_plane),
            enroll_token=args.enroll_token,
            name=args.name,
            url=_advertise_url(args),
            engine_kind=args.engine,
            model=spec.model_name,
            max_model_len=max_model_len or 0,
            hardware=detect_hardware(device),
            labels=labels,
            state_file=args.state_file,
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
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=max(5, int(args.drain_timeout)),
        http=JsonErrorsHttpTools,  # the 400s uvicorn answers itself in JSON too
    )
    uvicorn.Server(config).run()
    return 0


__all__ = ["add_arguments", "main"]
