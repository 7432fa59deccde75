"""The engine registry: one backend per engine kind of the contract, chosen
by import string, so checking a profile loads neither torch nor vLLM."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import PYTHON, ROOT, child_env
from workers import engines
from workers.engines.api import Backend, EngineSpec
from workers.profile import ENGINE_KINDS, EngineProfile, ProfileError

# In a fresh interpreter: this test process has torch loaded already.
CHOOSE_AND_CHECK = """
import json, sys
from workers import engines
from workers.engines.api import EngineSpec
from workers.profile import EngineProfile, ProfileError
refused = {}
for kind in engines.BACKENDS:
    spec = EngineSpec(kind=kind, model="/nowhere", device="cpu")
    backend = engines.backend(kind)
    engines.validate(spec, backend.default_profile("cpu"), 2048)
    try:
        engines.validate(spec, EngineProfile(block_size=32, max_num_seqs=4096), 2048)
    except ProfileError as exc:
        refused[kind] = sorted(exc.errors)
print(json.dumps({"refused": refused, "loaded": sorted({"torch", "vllm"} & set(sys.modules))}))
"""


def test_every_engine_kind_of_the_contract_has_a_backend() -> None:
    assert tuple(engines.BACKENDS) == ENGINE_KINDS
    for kind in ENGINE_KINDS:
        assert isinstance(engines.backend(kind), Backend)


def test_an_unknown_kind_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown engine 'sglang'; choose one of reference, vllm, sim"):
        engines.backend("sglang")


def test_choosing_a_backend_and_checking_profiles_loads_neither_torch_nor_vllm() -> None:
    done = subprocess.run(
        [PYTHON, "-c", CHOOSE_AND_CHECK], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["refused"] == {kind: ["max_num_batched_tokens"] for kind in ("reference", "vllm", "sim")}
    assert report["loaded"] == []


def test_each_backend_checks_its_own_rules() -> None:
    # vLLM's CPU attention needs blocks of a multiple of 32; the reference engine does not.
    profile = EngineProfile(block_size=16)
    engines.validate(EngineSpec(kind="reference", model="/m", device="cpu"), profile, None)
    with pytest.raises(ProfileError) as info:
        engines.validate(EngineSpec(kind="vllm", model="/m", device="cpu"), profile, None)
    assert list(info.value.errors) == ["block_size"]
    engines.validate(EngineSpec(kind="vllm", model="/m", device="cuda"), profile, None)


def test_the_default_profile_fits_the_device() -> None:
    assert engines.backend("reference").default_profile("cpu") == EngineProfile()
    assert engines.backend("vllm").default_profile("cpu").block_size == 32
    assert engines.backend("vllm").default_profile("cuda") == EngineProfile()


def test_a_spec_serves_under_its_directory_name_unless_named() -> None:
    assert EngineSpec(kind="reference", model="/models/tiny-model").model_name == "tiny-model"
    assert EngineSpec(kind="reference", model="/models/tiny-model", served_model_name="tiny").model_name == "tiny"
