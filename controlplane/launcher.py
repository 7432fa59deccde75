"""A small process supervisor for ``manage.py demo`` (and anything like it).

Each ``ProcessSpec`` is started in its own session (so one signal reaches
the process and every child it forks), its output goes to the console with
a name prefix and to ``<log_dir>/<name>.log``, and the next one starts once
it is ready (an HTTP URL answers, or a line appears in its output). Ctrl-C,
SIGTERM, or any supervised process exiting stops them all in reverse order:
SIGTERM to the group, then SIGKILL after a grace period.

It is also the one home of the embedded stack's command lines (``web_argv``,
``gateway_argv``, ``celery_worker_argv``, ``celery_beat_argv``,
``worker_argv``): the demo, the benchmarks and the end-to-end tests start the
same processes, and separate copies of a command line drift apart. Each
builder takes what differs between its callers and writes a flag only when
it is given, so a caller that leaves one to the program's default still does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from django.core.management.base import CommandError

STOP_GRACE_SECONDS = 10.0
# Every process of the stack runs on this interpreter, so it sees this
# virtual environment's packages.
PYTHON = sys.executable


@dataclass
class ProcessSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    ready_url: str | None = None  # ready when this answers 2xx (or any status, below)
    ready_on_any_status: bool = False  # e.g. a worker's /health is 503 until its engine loads
    ready_text: str | None = None  # ...or when this appears in its output
    ready_timeout_seconds: float = 120.0
    cwd: Path | None = None


class LaunchError(CommandError):
    """A process would not start or answer; management commands print it
    as a one-line error, not a traceback."""


class NotReached(LaunchError, TimeoutError):
    """What ``wait_until`` waited for did not happen in time (a TimeoutError
    to tests, a one-line error to management commands)."""


def free_port(count: int = 1, *, below_ephemeral: bool = False) -> int:
    """A port free on 127.0.0.1 now (the benchmarks', the demo's and the tests'
    one copy); with ``count``, the first of that many free ports in a row
    (``workers serve --count N`` listens on PORT..PORT+N-1).

    ``below_ephemeral``: from below the kernel's range for outgoing
    connections. A port from that range can be taken by any process's next
    outgoing connection before the server that was given it binds; at 200
    simulated workers (a load generator, heartbeats and scrapes all
    connecting) one was, seconds after it was handed out."""
    for _ in range(100):
        if below_ephemeral:
            port = random.randrange(BELOW_EPHEMERAL_FROM, _ephemeral_low() - count)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        if all(_bindable(port + i) for i in range(0 if below_ephemeral else 1, count)):
            return port
    raise OSError(f"no {count} free ports in a row on 127.0.0.1")


# The lowest port handed out below the ephemeral range (above the well-known and most registered ones).
BELOW_EPHEMERAL_FROM = 10000


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port the kernel gives outgoing connections (Linux's default 32768 elsewhere)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    *,
    interval: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Call ``predicate`` every ``interval`` seconds until it returns something
    true, and return that. After ``timeout`` seconds raise NotReached naming
    ``what`` and the last value, followed by ``detail()`` (say, the logs of
    the processes that should have made it happen)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            more = detail() if detail is not None else ""
            raise NotReached(f"{what}: not after {timeout:g}s (last: {value!r})" + (f"\n{more}" if more else ""))
        time.sleep(interval)


@contextlib.contextmanager
def child(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """One unsupervised process in its own session (benchmarks start theirs
    this way), output to ``log``; terminated, then killed, on the way out."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path | None = None, timeout: float = 90.0) -> None:
    """Until ``url`` answers below 500; LaunchError (with the log's tail) if
    the process exits first or the time runs out."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise LaunchError(f"{proc.args!r} exited with {proc.returncode}" + (f":\n{tail}" if tail else ""))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.1)
    raise LaunchError(f"{url} did not answer within {timeout:.0f}s")


def _answers(url: str, any_status: bool) -> bool:
    # httpx logs every request at INFO; readiness polls would flood the console.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        with httpx.Client(timeout=2.0) as client:
            response = client.get(url)
    except httpx.HTTPError:
        return False
    return response.is_success or any_status


class Running:
    def __init__(self, spec: ProcessSpec, log_dir: Path, echo: Callable[[str], None]):
        self.spec = spec
        self._seen = ""
        self._lock = threading.Lock()
        self.log_path = log_dir / f"{spec.name}.log"
        self._log: IO[str] = open(self.log_path, "w", buffering=1)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        self.popen = subprocess.Popen(
            list(spec.argv),
            cwd=spec.cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, args=(echo,), name=f"out-{spec.name}", daemon=True)
        self._reader.start()

    def _pump(self, echo: Callable[[str], None]) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._log.write(line)
            with self._lock:
                self._seen = (self._seen + line)[-20000:]
            echo(f"{self.spec.name:>14} | {line.rstrip()}")

    def seen(self, text: str) -> bool:
        with self._lock:
            return text in self._seen

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, stopping: threading.Event) -> None:
        spec = self.spec
        deadline = time.monotonic() + spec.ready_timeout_seconds
        while not stopping.is_set():
            if not self.alive():
                raise LaunchError(
                    f"{spec.name} exited with {self.popen.returncode} before it was ready; see {self.log_path}"
                )
            if spec.ready_text is not None and self.seen(spec.ready_text):
                return
            if spec.ready_url is not None and _answers(spec.ready_url, spec.ready_on_any_status):
                return
            if spec.ready_url is None and spec.ready_text is None:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{spec.name} not ready after {spec.ready_timeout_seconds:.0f}s; see {self.log_path}")
            stopping.wait(0.2)

    def stop(self, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        # Children that outlived their leader still share its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self._reader.join(timeout=2)
        self._log.close()


_ATTENTION = ("WARNING", "ERROR", "CRITICAL", "Traceback", "Error:", "error:")


def _needs_attention(line: str) -> bool:
    return any(word in line for word in _ATTENTION)


class Supervisor:
    """Start specs in order, watch them, stop them all on the first signal
    or the first unexpected exit."""

    def __init__(self, log_dir: Path, echo: Callable[[str], None] | None = None):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.running: list[Running] = []
        self.stopping = threading.Event()
        self._echo_lock = threading.Lock()
        self._echo = echo or self._print
        # Once everything is up, the console shows only what needs a human
        # (the full output stays in each process's log file).
        self.quiet = False

    def _print(self, line: str) -> None:
        if self.quiet and not _needs_attention(line):
            return
        with self._echo_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def start(self, spec: ProcessSpec) -> Running:
        if self.stopping.is_set():
            raise LaunchError("stopping")
        proc = Running(spec, self.log_dir, self._echo)
        self.running.append(proc)
        proc.wait_ready(self.stopping)
        return proc

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: object) -> None:
            self.stopping.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def watch(self) -> str | None:
        """Block until a signal or until a process exits; returns the name of
        the process that exited, or None for a signal."""
        while not self.stopping.wait(0.5):
            for proc in self.running:
                if not proc.alive():
                    self.stopping.set()
                    return proc.spec.name
        return None

    def stop_all(self) -> None:
        self.stopping.set()
        for proc in reversed(self.running):
            if proc.alive():
                self._echo(f"{'launcher':>14} | stopping {proc.spec.name}")
            proc.stop()
        self.running.clear()


# ---- the stack's command lines ---------------------------------------------------------


def web_argv(
    port: int, *, host: str | None = None, log_level: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The control plane's web server: uvicorn on ``controlplane.asgi``.
    ``host`` left out is uvicorn's 127.0.0.1; ``extra`` takes uvicorn's other
    flags (a benchmark's ``--workers``, ``--no-access-log``)."""
    argv = [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", *_given("--host", host)]
    return [*argv, "--port", str(port), *_given("--log-level", log_level), *extra]


def gateway_argv(
    port: int,
    *,
    host: str | None = None,
    log_level: str | None = None,
    command: Sequence[str] = ("rungateway",),
    extra: Sequence[str] = (),
) -> list[str]:
    """The gateway, ``manage.py rungateway`` (run from the repository root,
    where manage.py is). ``command`` is another that serves it
    (``("bench_gateway", "--serve-gateway")``: the gateway over the
    benchmark's httpx client)."""
    argv = [PYTHON, "manage.py", *command, *_given("--host", host), "--port", str(port)]
    return [*argv, *_given("--log-level", log_level), *extra]


def celery_worker_argv(
    node: str,
    *,
    queue: str | None = None,
    pool: str | None = None,
    concurrency: int | None = None,
    log_level: str = "INFO",
    beat_schedule: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """A Celery worker of the control plane's app, named ``node`` (``%h`` is
    the host name), consuming ``queue`` (a comma-separated list; left out:
    the default queue). ``pool="solo"`` runs each task in the worker's own
    process (the benchmarks' and tests' choice: one process to stop, nothing
    forked); ``beat_schedule`` runs beat inside it too, keeping its schedule
    there. Gossip and mingle are off: they only slow the start and talk to
    every other worker on the same broker, which a benchmark's or a test's
    worker shares with whatever else runs."""
    argv = [PYTHON, "-m", "celery", "-A", "controlplane", "worker", *_given("--pool", pool)]
    argv += ["--loglevel", log_level, *_given("--concurrency", concurrency), "--without-gossip", "--without-mingle"]
    argv += [*_given("-Q", queue), "-n", node]
    if beat_schedule is not None:
        argv += ["-B", "-s", str(beat_schedule)]
    return [*argv, *extra]


def celery_beat_argv(schedule: Path, *, log_level: str = "INFO") -> list[str]:
    """Celery beat on its own, keeping its schedule in ``schedule``. No
    pidfile: a beat killed in an earlier run must leave no lock behind that
    stops the next start."""
    return [
        *(PYTHON, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", log_level),
        *("--schedule", str(schedule), "--pidfile", ""),
    ]


@dataclass(frozen=True)
class Enrollment:
    """What a worker needs to join a control plane: its agent enrolls at
    ``control_plane`` with ``token`` as ``name`` and keeps the secret it gets
    in ``state_file`` (so a restart is not a second enrollment).
    ``advertise_url`` left out is the worker's own http://host:port."""

    control_plane: str
    token: str
    name: str
    state_file: Path
    advertise_url: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        argv = ["--control-plane", self.control_plane, "--enroll-token", self.token, "--name", self.name]
        argv += _given("--advertise-url", self.advertise_url)
        for key, value in self.labels.items():
            argv += ["--label", f"{key}={value}"]
        return [*argv, "--state-file", str(self.state_file)]


def worker_argv(
    model: Path | str | None,
    port: int,
    *,
    max_model_len: int | None = None,
    engine: str | None = None,
    host: str | None = None,
    device: str | None = None,
    log_level: str | None = None,
    profile: Mapping[str, Any] | None = None,
    enrollment: Enrollment | None = None,
    served_model_name: str | None = None,
    sim_system: str | None = None,
    sim_model: str | None = None,
    count: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """An inference worker, ``python -m workers serve``, on the checkpoint
    directory ``model``. Left out, ``engine`` is the reference engine, ``host``
    127.0.0.1 and ``device`` auto (a GPU when there is one; the benchmarks and
    tests say cpu, so a run does not change with the machine it lands on).
    ``profile`` is the engine profile it starts with; without ``enrollment``
    it serves alone, with no agent.

    Simulated workers (``engine="sim"``): ``model`` may be None (the shipped
    tokenizer), ``sim_system`` and ``sim_model`` name the GPU and the model
    whose measured step times it sleeps, and ``count`` serves that many from
    one process on ``port``.. and named ``<enrollment name>-0``.."""
    argv = [PYTHON, "-m", "workers", "serve", *_given("--engine", engine), *_given("--model", model)]
    argv += [*_given("--host", host), "--port", str(port), *_given("--max-model-len", max_model_len)]
    argv += [*_given("--device", device), *_given("--log-level", log_level)]
    argv += [*_given("--served-model-name", served_model_name), *_given("--sim-system", sim_system)]
    argv += [*_given("--sim-model", sim_model), *_given("--count", count)]
    if profile is not None:
        argv += ["--profile", json.dumps(profile)]
    if enrollment is not None:
        argv += enrollment.argv()
    return [*argv, *extra]


def _given(flag: str, value: object) -> list[str]:
    """``[flag, value]``, or nothing when ``value`` is None (the program's
    default applies)."""
    return [] if value is None else [flag, str(value)]
