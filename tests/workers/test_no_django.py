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
    # The walk reached the packages it should (the vLLM engine's module imports vLLM lazily, so it counts too).
    assert {
        "workers.engines",
        "workers.engines.api",
        "workers.engines.stream",
        "workers.engines.reference.llm_engine",
        "workers.engines.reference.backend",
        "workers.engines.vllm.engine",
        "workers.engines.vllm.backend",
        "workers.server.app",
        "workers.agent.agent",
    } <= set(report["modules"])
    assert report["django"] == []
