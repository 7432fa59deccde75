"""The engine a worker serves from, its admission gate, and profile switches.

``EngineHost`` owns the current ``AsyncEngine``. The HTTP server asks it to
admit each request (bounded: past ``max_num_seqs + max_queue`` in flight it
refuses with ``QueueFull`` → 429; while not ready, ``Unavailable`` → 503,
both before the first byte, so a client or gateway can retry elsewhere). The
agent asks it to apply a profile:

  1. validate the profile for this backend (nothing changes if it is bad);
  2. ``draining``: stop admitting, let in-flight requests finish, abort what
     is still running at the deadline;
  3. ``applying``: shut the old engine down, build and start the new one,
     generate one token as a health check;
  4. ``ready`` on the new revision — or, if the new engine failed, rebuild
     the last good profile and stay on it, keeping the error for the agent.

An engine that stops serving (its step thread died, or a step never ends:
the engine's ``health_error()``) turns the host ``unhealthy`` with that
reason, at the next look (/health, the agent's heartbeat, an admission):
/health answers 503 and the agent reports it to the control plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.engines.api import AsyncEngine, EngineLoad, SamplingParams
from workers.profile import EngineProfile, ProfileError

log = logging.getLogger(__name__)

LOADING, READY, DRAINING, APPLYING, UNHEALTHY = "loading", "ready", "draining", "applying", "unhealthy"


class Unavailable(Exception):
    """Not admitting now (loading, draining, applying): retry shortly."""

    def __init__(self, state: str):
        super().__init__(f"the worker is {state}; retry on another worker or shortly.")
        self.state = state


class NeverFits(Exception):
    """More prompts in one request than this worker can ever hold at once:
    retrying cannot help, so the request's own fault (400), not a full queue."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.capacity = capacity


class QueueFull(Exception):
    """More requests in flight than the engine runs plus the bounded queue."""


class ApplyError(RuntimeError):
    pass


@dataclass(frozen=True)
class RunningProfile:
    profile: EngineProfile
    revision_id: int | None = None  # the control plane's id; None: from the command line
    name: str = "local"
    revision: int | None = None


class Ticket:
    """One admitted request: which engine serves it; release it when done."""

    def __init__(self, host: EngineHost, engine: AsyncEngine, request_ids: list[str]):
        self.host, self.engine, self.request_ids = host, engine, request_ids
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.host._release(self)


class EngineHost:
    def __init__(
        self,
        build: Callable[[EngineProfile], AsyncEngine],
        running: RunningProfile,
        *,
        validate: Callable[[EngineProfile, int | None], None] | None = None,
        max_queue: int = 128,
        drain_timeout_seconds: float = 60.0,
        on_engine: Callable[[AsyncEngine, RunningProfile], None] | None = None,
    ):
        self._build = build
        self._validate = validate
        self.running = running
        self.max_queue = max_queue
        self.drain_timeout_seconds = drain_timeout_seconds
        self._on_engine = on_engine  # the metrics exporter attaches here
        self.engine: AsyncEngine | None = None
        self.state = LOADING
        self.operator_drain = False
        self.last_apply_error: str | None = None
        self.load_error: str | None = None
        self.health_error: str | None = None  # why the engine cannot serve (state unhealthy)
        self._in_flight: dict[int, Ticket] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._apply_lock = asyncio.Lock()
        self.state_changed = asyncio.Event()  # pulsed on every change, for the agent

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        # Under the apply lock: a profile the agent hears of while the first
        # engine loads waits for it rather than building a second one beside it.
        async with self._apply_lock:
            try:
                self.engine = await self._start_engine(self.running.profile)
            except Exception as exc:
                self.load_error = f"{type(exc).__name__}: {exc}"
                raise
            self._engine_ready(self.running)

    async def shutdown(self) -> None:
        self._set_state(DRAINING)
        await self._drain()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await engine.shutdown()

    async def _start_engine(self, profile: EngineProfile) -> AsyncEngine:
        engine = self._build(profile)
        try:
            await engine.start()
            await self._health_check(engine)
        except BaseException:
            await engine.shutdown()
            raise
        self.health_error = None  # a new engine: whatever broke the old one is gone
        return engine

    @staticmethod
    async def _health_check(engine: AsyncEngine) -> None:
        prompt = engine.encode("Hello") or [0]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        num_tokens = 0
        async for out in engine.generate(prompt, params, f"health-{uuid.uuid4().hex[:8]}"):
            num_tokens += len(out.outputs[0].token_ids)
        if num_tokens != 1:
            raise ApplyError(f"health check: the engine produced {num_tokens} tokens for max_tokens=1.")

    def _engine_ready(self, running: RunningProfile) -> None:
        self.running = running
        assert self.engine is not None
        if self._on_engine is not None:
            self._on_engine(self.engine, running)
        self._set_state(DRAINING if self.operator_drain else READY)

    def _set_state(self, state: str) -> None:
        if self.state == UNHEALTHY and self.health_error is not None and state != UNHEALTHY:
            return  # a broken engine stays reported broken until a new one replaces it
        if state != self.state:
            log.info("worker state: %s → %s", self.state, state)
            self.state = state
        self.state_changed.set()
        self.state_changed = asyncio.Event()

    def check_health(self) -> str | None:
        """Ask the engine whether it still serves; an engine that does not
        turns the host unhealthy (for good: only a restart or a new engine
        brings it back). Returns the reason, or None when healthy."""
        if self.state == UNHEALTHY:
            return self.health_error
        check = getattr(self.engine, "health_error", None)
        reason = check() if check is not None and not self._apply_lock.locked() else None
        if reason is not None:
            log.error("the engine cannot serve: %s", reason)
            self.health_error = reason
            self._set_state(UNHEALTHY)
        return reason

    # ---- admission ---------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return sum(len(t.request_ids) for t in self._in_flight.values())

    def admit(self, request_ids: list[str]) -> Ticket:
        self.check_health()
        if self.state != READY or self.engine is None:
            raise Unavailable(self.state)
        capacity = self.engine.profile.max_num_seqs + self.max_queue
        if len(request_ids) > capacity:
            raise NeverFits(capacity)
        if self.num_in_flight + len(request_ids) > capacity:
            raise QueueFull(f"{self.num_in_flight} requests in flight; this worker takes at most {capacity}.")
        ticket = Ticket(self, self.engine, request_ids)
        self._in_flight[id(ticket)] = ticket
        self._idle.clear()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self._in_flight.pop(id(ticket), None)
        if not self._in_flight:
            self._idle.set()

    def load(self) -> EngineLoad:
        if self.engine is None:
            return EngineLoad(0, 0, 0.0)
        return self.engine.load()

    # ---- draining and profile switches ---------------------------------------------
    def set_operator_drain(self, drain: bool) -> None:
        """The control plane asked to stop (or resume) admitting."""
        if drain == self.operator_drain:
            return
        self.operator_drain = drain
        if self.state in (READY, DRAINING) and not self._apply_lock.locked():
            self._set_state(DRAINING if drain else READY)

    async def _drain(self) -> None:
        """Wait for in-flight requests up to the deadline; abort the rest."""
        deadline = time.monotonic() + self.drain_timeout_seconds
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            tickets = list(self._in_flight.values())
            log.warning("drain deadline: aborting %d requests still in flight", len(tickets))
            for ticket in tickets:
                for request_id in ticket.request_ids:
                    await ticket.engine.abort(request_id)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=10.0)
            except TimeoutError:
                log.error("requests still in flight 10 s after their abort; rebuilding anyway")

    def check_profile(self, profile: EngineProfile) -> None:
        """Raise ProfileError if the backend cannot run ``profile``."""
        if self._validate is not None:
            max_model_len = self.engine.max_model_len if self.engine is not None else None
            self._validate(profile, max_model_len)

    async def apply(self, target: RunningProfile) -> None:
        """Switch to ``target``; raises ProfileError (nothing changed) or
        ApplyError (the new engine failed; the old profile serves again)."""
        async with self._apply_lock:
            self.check_profile(target.profile)
            previous = self.running
            started = time.monotonic()
            if target.profile == previous.profile and self.engine is not None:
                # The same knobs under another name or revision (often the
                # pool's revision matching the command line's profile at
                # start): adopt the name, rebuild nothing.
                self.last_apply_error = None
                self._engine_ready(target)
                return
            if await self._apply_live(target):
                log.info("applied profile %s r%s between two steps", target.name, target.revision)
                return
            self._set_state(DRAINING)
            await self._drain()
            self._set_state(APPLYING)
            if self.engine is not None:
                engine, self.engine = self.engine, None
                await engine.shutdown()
            try:
                self.engine = await self._start_engine(target.profile)
            except Exception as exc:
                self.last_apply_error = f"{type(exc).__name__}: {exc}"
                log.exception("applying profile %s r%s failed; restoring the last one", target.name, target.revision)
                self.engine = await self._start_engine(previous.profile)
                self._engine_ready(previous)
                raise ApplyError(self.last_apply_error) from exc
            self.last_apply_error = None
            self.load_error = None
            self._engine_ready(target)
            log.info("applied profile %s r%s in %.1f s", target.name, target.revision, time.monotonic() - started)

    async def _apply_live(self, target: RunningProfile) -> bool:
        """An engine that can change scheduler knobs between two steps (the
        reference engine's ``update_profile``) needs no drain and no rebuild:
        nothing is refused and every request in flight stays correct. One
        that cannot for this change (block size, KV size) says so with
        ProfileError, and the switch drains and rebuilds instead."""
        update = getattr(self.engine, "update_profile", None)
        if update is None or self.state != READY:
            return False
        self._set_state(APPLYING)
        try:
            await update(target.profile)
        except ProfileError as exc:
            log.info("profile %s r%s needs a rebuild: %s", target.name, target.revision, exc)
            return False
        finally:
            self._set_state(DRAINING if self.operator_drain else READY)
        self.last_apply_error = None
        self._engine_ready(target)
        return True

    def describe(self) -> dict[str, Any]:
        load = self.load()
        return {
            "status": self.state,
            "engine": getattr(self.engine, "engine_kind", None),
            "model": getattr(self.engine, "model_name", None),
            "profile": {
                "name": self.running.name,
                "revision": self.running.revision,
                "revision_id": self.running.revision_id,
                "fields": self.running.profile.to_dict(),
            },
            "load": {
                "num_requests_running": load.num_requests_running,
                "num_requests_waiting": load.num_requests_waiting,
                "kv_cache_usage_perc": load.kv_cache_usage_perc,
                "num_in_flight": self.num_in_flight,
            },
            "last_apply_error": self.last_apply_error,
            "load_error": self.load_error,
            "health_error": self.health_error,
        }
