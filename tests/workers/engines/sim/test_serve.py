"""``python -m workers serve --engine sim``: many simulated workers in one
process, each an OpenAI server labelled simulated; bad options end at once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.conftest import PYTHON, ROOT
from tests.support import child_env, free_port, running, wait_until
from tests.workers.engines.sim.conftest import MODEL, SYSTEM

SIM = ("--engine", "sim", "--sim-system", SYSTEM, "--sim-model", MODEL, "--max-model-len", "16384")


def test_count_workers_serve_from_one_process_each_on_its_port_and_labelled_simulated(tmp_path: Path) -> None:
    port = free_port(2)
    argv = [PYTHON, "-m", "workers", "serve", *SIM, "--served-model-name", "llama-sim", "--port", str(port)]
    with running([*argv, "--count", "2", "--log-level", "warning"], env=child_env(), log_path=tmp_path / "w.log") as p:
        for i in range(2):
            p.wait_http(f"http://127.0.0.1:{port + i}/health", timeout=120)
        health = [httpx.get(f"http://127.0.0.1:{port + i}/health").json() for i in range(2)]
        wait_until(
            lambda: all(httpx.get(f"http://127.0.0.1:{port + i}/health").json()["status"] == "ready" for i in range(2)),
            timeout=60,
        )
        assert [h["engine"] for h in health] == ["sim", "sim"]
        for i in range(2):
            r = httpx.post(
                f"http://127.0.0.1:{port + i}/v1/completions",
                json={"model": "llama-sim", "prompt": "The for statement", "max_tokens": 16},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        memory = next(
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("chunkpilot:memory_bytes{")
        )
        assert memory > 10e9  # an 8B model's weights in bf16: a GPU's figure, not the tiny model's megabytes


def test_an_unknown_system_ends_the_command_with_one_line_naming_the_option() -> None:
    result = subprocess.run(
        [PYTHON, "-m", "workers", "serve", "--engine", "sim", "--sim-system", "h900_sxm", "--sim-model", MODEL],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=120,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --sim-system:") and "h200_sxm" in last, result.stderr[-2000:]


def test_count_is_for_simulated_workers_only(tiny_model: Path) -> None:
    result = subprocess.run(
        [PYTHON, "-m", "workers", "serve", "--model", str(tiny_model), "--count", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=120,
    )
    assert result.returncode == 2
    assert "--count" in result.stderr
