"""The worker agent: registers, heartbeats, applies the desired profile.

Reconcile, don't remember: each heartbeat reply carries the desired profile
revision in full, and the agent compares it with what the engine runs now.
A different revision starts an apply in the background (the host drains,
rebuilds, health-checks); heartbeats keep going meanwhile and report
``draining`` → ``applying`` → ``ready`` on the new revision, the last one sent
as soon as the host is ready. A revision that failed to apply is not retried
until the control plane asks for a different one; its error rides on every
heartbeat (``apply_error``).

The control plane being unreachable changes nothing on the worker: it keeps
serving with the profile it has, and retries with capped backoff.

Each reply also says when to heartbeat next: a large fleet is told a longer
interval than a small one. The agent keeps to it within sane bounds, and to
its own interval when the reply says none (an older control plane).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from workers.agent.client import NO_INTERVAL, ControlPlaneClient, ControlPlaneError, Unauthorized, Unreachable
from workers.contract import (
    CONTRACT_VERSION,
    Hardware,
    HeartbeatReply,
    HeartbeatRequest,
    Load,
    ProfileRef,
    RegisterRequest,
)
from workers.profile import EngineProfile, ProfileError
from workers.server.host import ApplyError, EngineHost, RunningProfile

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 30.0
# However a reply is garbled, the agent neither floods the control plane nor
# goes silent for long enough to be taken for dead by any sane sweep.
MIN_HEARTBEAT_INTERVAL_SECONDS = 0.1
MAX_HEARTBEAT_INTERVAL_SECONDS = 60.0


class Agent:
    def __init__(
        self,
        host: EngineHost,
        client: ControlPlaneClient,
        *,
        enroll_token: str | None,
        name: str,
        url: str,
        engine_kind: str,
        model: str,
        max_model_len: int,
        hardware: Hardware,
        labels: dict[str, str] | None = None,
        state_file: Path | None = None,
        heartbeat_interval_seconds: float = 5.0,
    ):
        self.host = host
        self.client = client
        self.enroll_token = enroll_token
        self.name = name
        self.url = url
        self.engine_kind = engine_kind
        self.model = model
        self.max_model_len = max_model_len
        self.hardware = hardware
        self.labels = labels or {}
        self.state_file = state_file
        self.own_interval = heartbeat_interval_seconds
        self.interval = heartbeat_interval_seconds
        self.worker_id: int | None = None
        self.secret: str | None = None
        self.apply_error: str | None = None
        self.last_reply: HeartbeatReply | None = None
        self.reachable = False
        self._failed_revision_id: int | None = None
        self._apply_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._load_state()

    # ---- secret persistence --------------------------------------------------------
    def _load_state(self) -> None:
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return
        if data.get("control_plane") == self.client.base_url and data.get("name") == self.name:
            self.worker_id, self.secret = data.get("worker_id"), data.get("secret")

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "control_plane": self.client.base_url,
                    "name": self.name,
                    "worker_id": self.worker_id,
                    "secret": self.secret,
                },
                f,
            )
        tmp.replace(self.state_file)

    def _forget_secret(self) -> None:
        self.secret = None
        if self.state_file is not None:
            with contextlib.suppress(OSError):
                self.state_file.unlink()

    # ---- payloads --------------------------------------------------------------------
    def register_request(self) -> RegisterRequest:
        return RegisterRequest(
            contract_version=CONTRACT_VERSION,
            enroll_token=self.enroll_token or "",
            name=self.name,
            url=self.url,
            engine_kind=self.engine_kind,
            model=self.model,
            max_model_len=self.max_model_len,
            hardware=self.hardware,
            labels=self.labels,
        )

    def heartbeat_request(self) -> HeartbeatRequest:
        self.host.check_health()
        load = self.host.load()
        running = self.host.running
        return HeartbeatRequest(
            contract_version=CONTRACT_VERSION,
            state=self.host.state,
            load=Load(
                num_requests_running=load.num_requests_running,
                num_requests_waiting=load.num_requests_waiting,
                kv_cache_usage_perc=load.kv_cache_usage_perc,
            ),
            running_revision_id=running.revision_id,
            running_profile=running.profile.to_dict(),
            hardware=self.hardware,
            apply_error=self.apply_error or self.host.load_error,
            # Every beat says where the worker listens now: one restarted on
            # a new port with the same state file keeps its secret and never
            # registers again, so the control plane learns the URL here.
            url=self.url,
            health_error=self.host.health_error,
        )

    # ---- the loop ----------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            changed = self.host.state_changed
            try:
                if self.secret is None:
                    await self.register()
                await self.heartbeat()
                backoff = 1.0
                delay = self.interval
            except Unauthorized as exc:
                log.warning("control plane refused us (%s); registering again", exc)
                self._forget_secret()
                delay = backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                if not self.enroll_token:
                    log.error("no enrollment token to register again with; retrying in %.0f s", delay)
            except (Unreachable, ControlPlaneError) as exc:
                if self.reachable:
                    log.warning("control plane unreachable (%s); serving on with the last profile", exc)
                self.reachable = False
                delay = backoff
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            await self._sleep(delay, changed)

    async def _sleep(self, seconds: float, changed: asyncio.Event) -> None:
        """Until the next heartbeat is due, the host's state changes, or stop."""
        waits = [asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(changed.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def register(self) -> None:
        if not self.enroll_token:
            raise Unauthorized("no worker secret and no enrollment token")
        reply = await self.client.register(self.register_request())
        self.worker_id, self.secret = reply["worker_id"], reply["secret"]
        self.interval = self._told_interval(reply["heartbeat_interval_seconds"])
        self.reachable = True
        self._save_state()
        log.info("registered with %s as worker %s", self.client.base_url, self.worker_id)

    async def heartbeat(self) -> HeartbeatReply:
        assert self.secret is not None
        reply = await self.client.heartbeat(self.secret, self.heartbeat_request())
        if not self.reachable:
            log.info("control plane reachable at %s", self.client.base_url)
        self.reachable = True
        self.last_reply = reply
        self.interval = self._told_interval(reply["heartbeat_interval_seconds"])
        self.host.set_operator_drain(reply["drain"])
        self._reconcile(reply["desired"])
        return reply

    def _told_interval(self, seconds: float) -> float:
        """The interval a reply named, bounded; none named (NO_INTERVAL): our own."""
        if seconds == NO_INTERVAL:
            return self.own_interval
        return min(max(seconds, MIN_HEARTBEAT_INTERVAL_SECONDS), MAX_HEARTBEAT_INTERVAL_SECONDS)

    def _reconcile(self, desired: ProfileRef | None) -> None:
        if desired is None or (self._apply_task is not None and not self._apply_task.done()):
            return
        revision_id = desired["revision_id"]
        if revision_id == self.host.running.revision_id or revision_id == self._failed_revision_id:
            return
        self._apply_task = asyncio.ensure_future(self._apply(desired))

    async def _apply(self, desired: ProfileRef) -> None:
        revision_id = desired["revision_id"]
        try:
            profile = EngineProfile.from_dict(dict(desired["fields"]), engine_kind=self.engine_kind)
            log.info("applying profile %s r%s (revision id %s)", desired["name"], desired["revision"], revision_id)
            await self.host.apply(
                RunningProfile(profile, revision_id=revision_id, name=desired["name"], revision=desired["revision"])
            )
        except (ProfileError, ApplyError) as exc:
            self._failed_revision_id = revision_id
            self.apply_error = f"revision {revision_id}: {exc}"
            log.error("could not apply profile revision %s: %s", revision_id, exc)
        except Exception as exc:
            self._failed_revision_id = revision_id
            self.apply_error = f"revision {revision_id}: {type(exc).__name__}: {exc}"
            log.exception("applying profile revision %s crashed", revision_id)
        else:
            self._failed_revision_id = None
            self.apply_error = None

    async def wait_applied(self) -> None:
        if self._apply_task is not None:
            await asyncio.shield(self._apply_task)

    def status(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "registered": self.secret is not None,
            "control_plane_reachable": self.reachable,
            "apply_error": self.apply_error,
        }
