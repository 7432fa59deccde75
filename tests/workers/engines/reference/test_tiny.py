"""make-tiny-model: the shipped checkpoint, copied (so every machine has the
same bytes); instant when there; training deterministic for a seed; safe to
run from several processes at once."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from tests.support import PYTHON, ROOT
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.tiny import RECIPE_VERSION, SHIPPED_DIR, STAMP, TRAIN_STEPS


def digest(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def make(out: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PYTHON, "-m", "workers", "make-tiny-model", str(out), "--quiet", *extra], cwd=ROOT)


def test_tiny_model_is_a_llama_checkpoint_vllm_can_run(tiny_model: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_model)
    raw = json.loads((tiny_model / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert config.head_dim == 64 and config.max_position_embeddings >= 32768
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in tiny_model.iterdir()
    }
    assert "chat_template" in json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert (tiny_model / "model.safetensors").stat().st_size < 16 << 20


def test_make_tiny_model_is_instant_when_the_checkpoint_is_there(tiny_model: Path) -> None:
    before = digest(tiny_model)
    started = time.monotonic()
    assert make(tiny_model).wait() == 0
    assert time.monotonic() - started < 20  # interpreter start-up, no training
    assert digest(tiny_model) == before


def test_concurrent_builds_agree_and_a_seed_gives_the_same_bytes(tmp_path: Path) -> None:
    # Short training keeps this quick; determinism does not depend on the length.
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [make(a, "--train-steps", "3"), make(a, "--train-steps", "3"), make(b, "--train-steps", "3")]
    assert [p.wait(timeout=600) for p in procs] == [0, 0, 0]
    assert digest(a) == digest(b)
    assert json.loads((a / STAMP).read_text()) == {"recipe": RECIPE_VERSION, "seed": 0, "train_steps": 3}
    assert not list(tmp_path.glob(".a.building-*"))
    c = tmp_path / "c"
    assert make(c, "--train-steps", "3", "--seed", "1").wait(timeout=600) == 0
    assert digest(c)["model.safetensors"] != digest(a)["model.safetensors"]


def test_the_shipped_checkpoint_is_what_its_stamp_says_and_make_copies_it(tmp_path: Path) -> None:
    stamp = json.loads((SHIPPED_DIR / STAMP).read_text())
    weights = (SHIPPED_DIR / "model.safetensors").read_bytes()
    assert stamp == {
        "recipe": RECIPE_VERSION,
        "seed": 0,
        "train_steps": TRAIN_STEPS,
        "sha256": hashlib.sha256(weights).hexdigest(),
    }
    out = tmp_path / "tiny-model"
    assert make(out).wait(timeout=120) == 0
    assert digest(out) == digest(SHIPPED_DIR)


def test_a_checkpoint_trained_on_this_machine_is_replaced_by_the_shipped_one(tmp_path: Path) -> None:
    """What an older checkout left in var/: the recipe's stamp without the
    shipped weights' hash (and, on another CPU, other weights)."""
    out = tmp_path / "tiny-model"
    assert make(out).wait(timeout=120) == 0
    (out / STAMP).write_text(json.dumps({"recipe": RECIPE_VERSION, "seed": 0, "train_steps": TRAIN_STEPS}))
    (out / "model.safetensors").write_bytes(b"other weights")
    assert make(out).wait(timeout=120) == 0
    assert digest(out) == digest(SHIPPED_DIR)
