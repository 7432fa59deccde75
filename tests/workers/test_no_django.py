"""``workers/`` never imports Django: a worker host runs without the control
plane's dependencies. Every module is imported in a fresh interpreter (the
test process itself has Django loaded by pytest-django)."""

from __future__ import annotations

import json
import subprocess

from tests.support import PYTHON, ROOT, child_env

SCRIPT = """
import importlib, json, pkgutil, sys
import workers
names = sorted(m.name for m in pkgutil.walk_packages(workers.__path__, "workers."))
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "django": sorted(m for m in sys.modules if m.split(".")[0] == "django")}))
"""


def test_importing_every_workers_module_loads_no_django() -> None:
    env = child_env()
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run([PYTHON, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # The walk reached the packages it should (vllm_backend's modules import vLLM lazily, so they count too).
    assert {"workers.engine.llm_engine", "workers.server.app", "workers.agent.agent", "workers.vllm_backend.engine"} <= set(report["modules"])
    assert report["django"] == []
