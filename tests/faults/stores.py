"""Stores a fault-injection test owns, so it may stop and start them: a
PostgreSQL cluster of its own (``initdb``/``pg_ctl`` on a spare port) and a
``redis-server`` of its own. Neither is the machine's shared pair that the
rest of the suite uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import redis

from tests.support import Process, free_port, wait_until


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as ``postgres``.
    Debian keeps its programs off PATH, under /usr/lib/postgresql/<version>/bin."""
    program = shutil.which(argv[0]) or next(
        iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{argv[0]}"))[-1:]), None
    )
    if program is None:
        raise RuntimeError(f"{argv[0]} not found: install PostgreSQL's server (apt-get install postgresql)")
    argv = [str(program), *argv[1:]]
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


class OwnPostgres:
    """A throwaway cluster: trust auth, no fsync (nothing here must survive a
    power cut), listening on 127.0.0.1 only."""

    def __init__(self) -> None:
        self.port = free_port()
        # Not under pytest's tmp_path: its parents are root's, mode 0700.
        self.root = Path(tempfile.mkdtemp(prefix="chunkpilot-faults-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        subprocess.run(
            _as_postgres(["initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"]),
            check=True,
            capture_output=True,
        )

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/chunkpilot"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        subprocess.run(
            _as_postgres(["pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start"]),
            check=True,
            capture_output=True,
        )

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, as in a crash or failover."""
        subprocess.run(
            _as_postgres(["pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop"]), check=True, capture_output=True
        )

    def create_database(self) -> None:
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE chunkpilot")

    def dsn(self, name: str = "chunkpilot") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn(), connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()

    def remove(self) -> None:
        subprocess.run(_as_postgres(["pg_ctl", "-D", str(self.data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


class OwnRedis:
    """A redis-server that keeps nothing across a restart, as a Redis without
    persistence loses its queue, its channel-layer groups and its hashes."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.log_dir = log_dir
        self.proc: Process | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = Process(argv, env=None, log_path=self.log_dir / f"redis-{self.starts}.log", cwd=self.log_dir)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        wait_until(lambda: _pings(client), 20, "redis-server up")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
