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
        PYTHON,
        "-m",
        "workers",
        "bench",
        "--quick",
        "--vllm",
        "off",
        "--model",
        str(tiny_model),
        "--budgets",
        ",".join(map(str, BUDGETS)),
        "--scenarios",
        "mixed,long-alone",
        "--json",
        str(path),
    ]
    done = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]

    ratios = json.loads(path.read_text())["ratios"]
    for budget in BUDGETS:
        for name in ("stall_reduction", "throughput_vs_monolithic", "long_alone_vs_monolithic"):
            value = ratios.get(f"{name} chunked-{budget}")
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, budget, value)


def test_bench_on_a_captured_workload_runs_the_profile_on_the_requests_replay_draws(
    tmp_path: Path, tiny_model: Path
) -> None:
    from workers import loadgen, replay

    spec = replay.from_plan(loadgen.plan("burst", duration_seconds=30, rate=2.0, seed=0), 30)
    path, out = tmp_path / "workload.json", tmp_path / "bench.json"
    path.write_text(json.dumps({"spec": spec.to_dict()}))
    profile = {
        "prefill_mode": "chunked",
        "max_num_batched_tokens": 128,
        "long_prefill_token_threshold": 64,
        "max_num_seqs": 16,
        "block_size": 32,
    }
    argv = [
        PYTHON,
        "-m",
        "workers",
        "bench",
        "--vllm",
        "off",
        "--model",
        str(tiny_model),
        "--workload",
        str(path),
        "--profile",
        json.dumps(profile),
        "--scenarios",
        "mixed",
        "--duration",
        "3",
        "--warmup",
        "1",
        "--max-model-len",
        "512",
        "--json",
        str(out),
    ]
    done = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    mixed = json.loads(out.read_text())["mixed"]
    assert list(mixed) == ["profile"]  # that profile only, not the monolithic and budget grid
    expected = replay.sample(
        spec, vocabulary=replay.vocabulary(tiny_model), seed=0, duration_seconds=3, block_size=32, max_model_len=512
    )  # what replay and an experiment's arm send
    assert mixed["profile"]["requests"] == len(expected) > 0
    assert mixed["profile"]["prompt_tokens"] == sum(len(r.prompt_token_ids or []) for r in expected)
    assert mixed["profile"]["output_tokens"] == sum(r.max_tokens for r in expected)  # EOS ignored: every token
