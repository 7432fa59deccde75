"""``python -m workers bench`` runs end to end and writes the ratios the
README quotes. A smoke test of the harness: the figures themselves are the
benchmark's to print, never asserted here."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.support import PYTHON, ROOT, child_env

BUDGETS = (256, 512)


@pytest.mark.slow
def test_quick_bench_writes_every_readme_ratio_finite_and_positive(tmp_path: Path, tiny_model: Path) -> None:
    path = tmp_path / "bench.json"
    # --quick replays 8 s of arrivals per configuration; two budgets and no
    # offline batch keep the run near half a minute.
    argv = [
        PYTHON, "-m", "workers", "bench", "--quick", "--vllm", "off", "--model", str(tiny_model),
        "--budgets", ",".join(map(str, BUDGETS)), "--scenarios", "mixed,long-alone", "--json", str(path),
    ]
    done = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]

    ratios = json.loads(path.read_text())["ratios"]
    for budget in BUDGETS:
        for name in ("stall_reduction", "throughput_vs_monolithic", "long_alone_vs_monolithic"):
            value = ratios.get(f"{name} chunked-{budget}")
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, budget, value)
