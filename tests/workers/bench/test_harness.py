"""The benchmarks' one replay harness (``workers.bench.harness``): the same
adapter serves ``bench`` (an engine it builds and frees) and ``gpu-check``
(an engine handed in and reused across runs)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from tests.support import ROOT
from workers.bench.harness import ReferenceAdapter, Request, replay
from workers.engines.reference import LLMEngine


def workload(num: int, max_tokens: int) -> list[Request]:
    return [Request(f"r{i}", 0.0, [0] + [3 + i + j for j in range(40)], max_tokens) for i in range(num)]


def test_replay_times_every_token_of_every_request(tiny_model: Path) -> None:
    adapter = ReferenceAdapter.build("t", tiny_model, {"max_num_batched_tokens": 64}, 256)
    requests, duration = replay(adapter, workload(3, 5))
    adapter.close()
    assert sorted(m.num_output_tokens for m in requests) == [5, 5, 5]
    for m in requests:
        assert len(m.token_times) == 5 and m.first_token_time == m.token_times[0]
        assert m.arrival_time <= m.first_token_time <= (m.finished_time or 0)
    assert duration > 0 and adapter.steps


def test_an_engine_handed_in_is_let_go_of_and_runs_again_with_its_memory_accounted(tiny_model: Path) -> None:
    engine = LLMEngine(tiny_model, max_model_len=256)
    first = ReferenceAdapter("first", engine, account_memory=True)
    replay(first, workload(2, 3))
    first.close()
    assert engine.observers == []
    assert len(first.accounted) == len(first.steps) > 0
    # The same steps, only their memory figures taken from the accounting formula.
    assert [
        dataclasses.replace(a, memory_bytes=s.memory_bytes, peak_memory_bytes=s.peak_memory_bytes)
        for a, s in zip(first.accounted, first.steps, strict=True)
    ] == first.steps
    assert all(a.memory_bytes > 0 for a in first.accounted)
    second = ReferenceAdapter("second", engine)
    requests, _ = replay(second, workload(1, 4))
    second.close()
    assert [m.num_output_tokens for m in requests] == [4]
    assert second.accounted == [] and len(second.steps) > 0


def test_no_product_module_of_workers_imports_the_benchmarks() -> None:
    found = []
    for path in sorted((ROOT / "workers").rglob("*.py")):
        if "bench" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("workers.bench")]
    assert found == []
