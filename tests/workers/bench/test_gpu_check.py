"""``python -m workers gpu-check --device cpu --quick``: the GPU check's own
code, on tiny shapes, so it cannot rot between device leases. The figures
are the device run's to give; here the report's shape and the parity and
memory verdicts the CPU can judge."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import PYTHON, ROOT, child_env
from workers.bench.gpu_check import PARITY_CAPS, QUICK, SECTIONS, STALL_BUDGETS


@pytest.mark.slow
def test_quick_cpu_run_writes_every_section_and_chunked_greedy_matches_monolithic(
    tmp_path: Path, tiny_model: Path
) -> None:
    out = tmp_path / "gpu-check"
    # --time-scale: no section may stop early for a slow, shared machine.
    argv = [
        PYTHON,
        "-m",
        "workers",
        "gpu-check",
        "--device",
        "cpu",
        "--quick",
        "--out",
        str(out),
        "--tiny-model",
        str(tiny_model),
        "--time-scale",
        "50",
    ]
    done = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((out / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(SECTIONS)
    for name, section in sections.items():
        assert "error" not in section, (name, section.get("error"))
        assert section["skipped"] == [], name

    parity = sections["parity"]
    assert parity["float32_identical"] is True
    for key in ("tiny float32", "tiny bfloat16", "big float32", "big bfloat16"):
        assert sorted(parity[key]["caps"]) == sorted(map(str, PARITY_CAPS)), key
        for cap in parity[key]["caps"].values():
            assert len(cap["first_difference"]) == len(QUICK.parity_prompts)
    for key in ("tiny float32", "big float32"):
        assert all(c["first_difference"] == [None] * len(QUICK.parity_prompts) for c in parity[key]["caps"].values())

    memory = sections["memory"]
    assert memory["on_allocator"] is False
    for run in memory["runs"].values():
        assert run["accounted_peak_bytes"] >= run["accounted_mean_bytes"] > 0
        assert run["allocator_peak_bytes"] is None  # no allocator on CPU
    assert memory["falls_with_chunking"] is True  # what the accounting says chunking does to peak/mean

    stalls = sections["stalls"]
    assert sorted(stalls["runs"]) == sorted(["monolithic", *(f"chunked-{b}" for b in STALL_BUDGETS)])
    for label, ratio in stalls["ratios"].items():
        assert ratio["stall_reduction"] > 0 and ratio["throughput_vs_monolithic"] > 0, label

    roofline = sections["roofline"]
    assert sorted(roofline["decode"]) == sorted(map(str, QUICK.roofline_batches))
    for d in roofline["decode"].values():
        assert 0 < d["fraction_of_roofline"] and d["tokens_per_second"] > 0
    assert roofline["prefill"]["fraction_of_matmul_rate"] > 0

    overhead = sections["overhead"]
    assert overhead["steps"] == QUICK.overhead_steps
    assert 0 <= overhead["outside_model_share"] <= 1
    assert overhead["schedule_seconds"] > 0 and overhead["pack_seconds"] >= 0
    sim = sections["sim"]
    assert (sim["system"], sim["on_that_gpu"]) == ("h200_sxm", False)  # off a GPU: said so beside its ratios
    assert [(r["prefill_tokens"], r["decodes"]) for r in sim["shapes"]] == [(p, d) for p, d, _ in QUICK.sim_shapes]
    assert all(r["measured_seconds"] > 0 and r["sim_seconds"] > 0 for r in sim["shapes"])

    text = (out / "gpu_check.txt").read_text()
    assert "float32 token-identical: True" in text
