"""The embedded stack's command lines, as the end-to-end suites start them:
the web server, the gateway, a real Celery worker and enrolled reference
workers (each suite adds its own environment and waits)."""

from __future__ import annotations

from pathlib import Path

from tests.support import PYTHON


def web_argv(port: int) -> list[str]:
    """The control plane's web server."""
    return [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(port), "--log-level", "warning"]


def gateway_argv(port: int) -> list[str]:
    return [PYTHON, "manage.py", "rungateway", "--port", str(port), "--log-level", "warning"]


def celery_worker_argv(queue: str, node: str, *extra: str) -> list[str]:
    """A real Celery worker (solo pool) on ``queue``, named ``node``."""
    return [
        *(PYTHON, "-m", "celery", "-A", "controlplane", "worker", "--pool", "solo", "--loglevel", "INFO"),
        *("--without-gossip", "--without-mingle", "-Q", queue, "-n", node, *extra),
    ]


def enrolled_worker_argv(
    model: Path, port: int, max_model_len: int, control_plane: str, token: str, name: str, state_file: Path
) -> list[str]:
    """A reference worker on ``model`` that enrolls with ``control_plane``."""
    return [
        *(PYTHON, "-m", "workers", "serve", "--model", str(model), "--port", str(port)),
        *("--max-model-len", str(max_model_len), "--device", "cpu", "--log-level", "warning"),
        *("--control-plane", control_plane, "--enroll-token", token, "--name", name),
        *("--advertise-url", f"http://127.0.0.1:{port}", "--state-file", str(state_file)),
    ]


__all__ = ["celery_worker_argv", "enrolled_worker_argv", "gateway_argv", "web_argv"]
