"""Helpers the test suites share: real processes on free ports, waited for and
reaped, with their output kept for the failure report. ``free_port`` and
``wait_until`` are the control plane's own (``controlplane.launcher``), the
one copy of each that the benchmarks use too; ``wait_until_async`` is
``wait_until`` for a test that runs on an event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from controlplane.launcher import NotReached, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


async def wait_until_async(
    predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition", *, interval: float = 0.01
) -> Any:
    """``wait_until`` on the running event loop: ``predicate`` is tried every
    ``interval`` seconds, the loop serving everything else in between, and
    its first true value returned; after ``timeout`` seconds NotReached."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise NotReached(f"{what}: not after {timeout:g}s (last: {value!r})")
        await asyncio.sleep(interval)


PYTHON = sys.executable


class Process:
    """A child process whose combined output goes to a log file."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None, log_path: Path, cwd: Path = ROOT):
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so stop() reaches its children too
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 60.0, ok: Sequence[int] = (200,)) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.argv[:4]} exited with {self.popen.returncode}:\n{self.output()[-4000:]}")
            try:
                r = httpx.get(url, timeout=2.0)
                if r.status_code in ok:
                    return
                last = r.status_code
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"{url} not ready after {timeout}s (last: {last}):\n{self.output()[-4000:]}")

    def wait_for_output(self, needle: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.output():
                return
            if not self.alive():
                raise RuntimeError(f"{self.argv[:4]} exited with {self.popen.returncode}:\n{self.output()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{needle!r} not seen after {timeout}s:\n{self.output()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.popen.wait(5)
        else:
            # The session may still hold children (a server's workers).
            self.kill(signal.SIGKILL)
        self._log.close()
        return self.popen.returncode


@contextlib.contextmanager
def running(argv: Sequence[str], *, env: dict[str, str] | None = None, log_path: Path) -> Iterator[Process]:
    proc = Process(argv, env=env, log_path=log_path)
    try:
        yield proc
    finally:
        proc.stop()


def child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(overrides)
    return env


class Traffic:
    """Bursty ``workers loadgen`` traffic through a gateway, in back-to-back
    runs on ``loops`` threads (each started ``stagger`` seconds after the one
    before, so traffic never stops between runs) until the block ends: each
    run's summary, and why each run that did not finish cleanly did not."""

    def __init__(
        self,
        url: str,
        key: str,
        *,
        rate: float,
        duration: float,
        loops: int = 1,
        stagger: float = 0.0,
        sticky_keys: int | None = None,
        timeout: float = 600.0,
    ):
        self.url, self.key = url, key
        self.rate, self.duration, self.sticky_keys, self.timeout = rate, duration, sticky_keys, timeout
        self.stagger = stagger
        self.summaries: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(loops)]

    def __enter__(self) -> Traffic:
        for i, thread in enumerate(self._threads):
            if i:
                time.sleep(self.stagger)
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    @property
    def num_requests(self) -> int:
        return sum(s["num_requests"] for s in self.summaries)

    def _loop(self, loop: int) -> None:
        seed = loop * 1000
        sticky = ["--sticky-keys", str(self.sticky_keys)] if self.sticky_keys else []
        while not self._stop.is_set():
            seed += 1
            argv = [
                *(PYTHON, "-m", "workers", "loadgen", "--url", self.url, "--api-key", self.key),
                *("--scenario", "burst", "--rate", f"{self.rate:g}", "--burst-period", "2"),
                *("--duration", f"{self.duration:g}", *sticky, "--seed", str(seed), "--json"),
            ]
            done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=self.timeout)
            try:
                self.summaries.append(json.loads(done.stdout)["summary"])
            except (ValueError, KeyError):
                pass
            if done.returncode != 0 or not done.stdout:
                self.failures.append(f"loadgen {seed} exited {done.returncode}: {done.stderr[-2000:]}")


__all__ = [
    "PYTHON",
    "ROOT",
    "Process",
    "Traffic",
    "child_env",
    "free_port",
    "running",
    "wait_until",
    "wait_until_async",
]
