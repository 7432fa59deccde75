"""The layer order: a module imports only from its own layer or lower ones.

Read from the source (ast), every import counts: at module level, under
``TYPE_CHECKING`` and inside functions. A lower layer that needs to call up
takes a hook registered from above (``metrics.exposition.register`` takes the
rollout gauges, ``alerts.killswitch.register`` the rollouts it may abort).
Besides the order this holds: no module reads another app's private names;
``controlplane`` takes from ``workers`` only the modules they share (the
benchmarks, ``controlplane.bench``, aside: they measure the data plane, and
nothing else imports them); and an import inside a function in
``controlplane/`` says why it is not at the top (a comment just above it: it
breaks a cycle, or it must wait for the app registry). The few deliberate
exceptions are listed below, each with its reason.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT

TOP = 100
# The order, lowest first. An app's every module sits in the app's layer.
LAYERS: dict[str, int] = {
    # 0: the base every app may use
    "controlplane": 0,  # the package itself (the Celery app)
    "controlplane.conf": 0,
    "controlplane.live": 0,
    "controlplane.launcher": 0,
    "controlplane.embedded": 0,
    "controlplane.admin_readonly": 0,
    "controlplane.outages": 0,
    "controlplane.celery": 0,
    "controlplane.settings": 0,
    "controlplane.accounts": 1,
    "controlplane.audit": 1,
    "controlplane.profiles": 2,
    "controlplane.fleet": 3,
    "controlplane.gateway": 4,
    "controlplane.metrics": 5,
    "controlplane.alerts": 6,
    "controlplane.rollouts": 7,
    "controlplane.experiments": 8,
    "controlplane.advisor": 9,
    # the top: the UI and the composition roots, which wire every app together
    "dashboards": TOP,
    "controlplane.urls": TOP,
    "controlplane.api_urls": TOP,
    "controlplane.asgi": TOP,
    "controlplane.demo": TOP,
    "controlplane.bench": TOP,  # the benchmarks: they drive every app and the real processes
    # A management command lives in an app but may wire many (each listed with why).
    "controlplane.fleet.management.commands.demo": TOP,  # `make demo`: starts every process of every app
}
# Single imports against the order, each with its reason: none.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}
# What controlplane and dashboards may take from workers/ (which never imports them). The
# benchmarks (BENCH) may take any module: they measure the data plane, and no product module imports them.
BENCH = "controlplane.bench"
SHARED_WORKERS_MODULES = {
    "workers.contract",
    "workers.profile",
    "workers.figures",
    "workers.loadgen",
    "workers.replay",
    "workers.openai_error",  # the one OpenAI error type: the gateway reads workers' error bodies through it
    "workers.openai_rules",  # the one request validator: a worker called directly refuses what the gateway does
    # Predict mode's one door to the simulated engine: a facade rather than exceptions for
    # engines.sim.virtual, steptime and fit, so the experiments app sees four names (which workers
    # can be simulated, the device, fitting, a prediction) and none of the engine's internals.
    "workers.predict",
}
WORKERS_EXCEPTIONS = {
    (
        "controlplane.gateway.metrics",
        "workers.server.metrics",
    ): "the gateway's histograms use the workers' bucket boundaries, so that the two views line up",
    (
        "controlplane.demo",
        "workers.engines.reference.tiny",
    ): "the demo asks whether its data dir already holds the shipped tiny model, so a restart copies nothing",
}
# Function-level imports left without a comment saying why: none.
LAZY_EXCEPTIONS: dict[tuple[str, str], str] = {}
PROJECT = ("controlplane", "dashboards", "workers")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (a name imported from a package counts as its submodule)
    line: int
    in_function: bool
    commented: bool  # a comment on its line or just above its run of imports
    private_names: tuple[str, ...]  # names starting with "_" taken from the target


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of the longest entry of LAYERS that names ``module`` or a
    package above it; None for a module outside controlplane and dashboards."""
    if module.split(".")[0] not in ("controlplane", "dashboards"):
        return None
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(module: str, source: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every project import in ``source``, the text of ``module``."""
    lines = source.splitlines()
    package = module if is_package else module.rpartition(".")[0]

    def commented(node: ast.stmt) -> bool:
        if "#" in lines[node.lineno - 1]:
            return True
        above = node.lineno - 2
        while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
            above -= 1
        return above >= 0 and lines[above].strip().startswith("#")

    def visit(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] in PROJECT:
                        yield Import(module, alias.name, child.lineno, in_function, commented(child), ())
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    source_module = ".".join(base + ([child.module] if child.module else []))
                else:
                    source_module = child.module or ""
                if source_module.split(".")[0] not in PROJECT:
                    continue
                plain = []
                for alias in child.names:
                    if _is_module(f"{source_module}.{alias.name}"):
                        yield Import(
                            module, f"{source_module}.{alias.name}", child.lineno, in_function, commented(child), ()
                        )
                    else:
                        plain.append(alias.name)
                if plain:
                    private = tuple(name for name in plain if name.startswith("_"))
                    yield Import(module, source_module, child.lineno, in_function, commented(child), private)
            yield from visit(child, inside)

    yield from visit(ast.parse(source), False)


def private_attribute_reads(module: str, source: str) -> Iterator[tuple[str, str, int]]:
    """``alias._name`` where ``alias`` is a project module imported under that name."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PROJECT:
            for alias in node.names:
                if _is_module(f"{node.module}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.split(".")[0] in PROJECT:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            yield aliases[node.value.id], node.attr, node.lineno


def app_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "controlplane" else parts[0]


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """What ``module`` (of text ``source``) does against the rules above."""
    found = []
    here = layer_of(module)
    if here is None:
        return [f"{module}: in no layer; add its app to LAYERS"]
    for imp in imports_of(module, source, is_package=is_package):
        where = f"{module}:{imp.line}"
        if imp.target.split(".")[0] == "workers":
            if (
                imp.target not in SHARED_WORKERS_MODULES
                and (module, imp.target) not in WORKERS_EXCEPTIONS
                and app_of(module) != BENCH
            ):
                found.append(f"{where} imports {imp.target}: not a module workers/ shares")
            continue
        if app_of(imp.target) == BENCH and app_of(module) != BENCH:
            found.append(f"{where} imports {imp.target}: the benchmarks are outside the product")
            continue
        there = layer_of(imp.target)
        if there is None:
            found.append(f"{where} imports {imp.target}, which is in no layer")
        elif there > here and (module, imp.target) not in LAYER_EXCEPTIONS:
            found.append(f"{where} imports {imp.target} (layer {there}) from layer {here}")
        if imp.private_names and app_of(imp.target) != app_of(module):
            found.append(f"{where} takes {', '.join(imp.private_names)}: private names of {imp.target}")
        if (
            imp.in_function
            and not imp.commented
            and module.startswith("controlplane.")
            and (module, imp.target) not in LAZY_EXCEPTIONS
        ):
            found.append(
                f"{where} imports {imp.target} inside a function with no comment saying why: "
                "move it to the top, or say what it waits for"
            )
    for target, name, line in private_attribute_reads(module, source):
        if app_of(target) != app_of(module):
            found.append(f"{module}:{line} reads {target}.{name}, a private name")
    return found


def project_modules() -> Iterator[tuple[str, Path]]:
    for top in ("controlplane", "dashboards"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" not in path.parts:
                yield module_name(path), path


def test_every_import_follows_the_layer_order() -> None:
    found = []
    for module, path in project_modules():
        found += violations(module, path.read_text(), is_package=path.name == "__init__.py")
    assert found == []


def test_the_walk_reaches_every_app_and_the_ui() -> None:
    seen = {app_of(module) for module, _ in project_modules()}
    assert {"controlplane.fleet", "controlplane.gateway", "controlplane.rollouts", "dashboards"} <= seen


def test_an_upward_import_is_caught_at_module_level_and_inside_a_function() -> None:
    source = (
        "from controlplane.rollouts.models import Rollout\n\ndef f():\n    from controlplane.alerts import models\n"
    )
    found = violations("controlplane.fleet.models", source)
    assert any("controlplane.rollouts.models (layer 7) from layer 3" in v for v in found)
    assert any("controlplane.alerts.models (layer 6) from layer 3" in v for v in found)


def test_a_private_name_of_another_app_is_caught_imported_or_read() -> None:
    source = "from controlplane.metrics import query\nfrom controlplane.metrics.query import _dt\nquery._clean(1)\n"
    found = violations("controlplane.alerts.sources", source)
    assert any("takes _dt" in v for v in found) and any("query._clean" in v for v in found)
    assert violations("controlplane.metrics.reader", source) == []  # within its own app


def test_a_lazy_import_must_say_why_and_a_workers_module_must_be_shared() -> None:
    silent = "def f():\n    from controlplane.fleet.models import Worker\n"
    said = (
        "def f():\n    # Imported here: models import this module.\n    from controlplane.fleet.models import Worker\n"
    )
    assert any("no comment" in v for v in violations("controlplane.gateway.api", silent))
    assert violations("controlplane.gateway.api", said) == []
    assert any(
        "not a module workers/ shares" in v
        for v in violations("controlplane.gateway.api", "from workers.engine.scheduler import Scheduler\n")
    )


def test_the_benchmarks_may_drive_anything_and_nothing_imports_them() -> None:
    bench = (
        "from controlplane.rollouts.models import Rollout\nfrom dashboards.metrics.views import panel\n"
        "from workers.server.metrics import MetricsExporter\n"
    )
    assert violations("controlplane.bench.management.commands.bench_metrics", bench) == []
    found = violations("dashboards.metrics.views", "from controlplane.bench import gateway\n")
    assert any("the benchmarks are outside the product" in v for v in found)


def pure_cores_in_the_docs() -> list[str]:
    """The modules docs/architecture.md's apps table names as pure cores (its last column)."""
    names = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[1].startswith("`") and cells[2].isdigit():
            app = cells[1].strip("`")
            names += [f"controlplane.{app}.{n[:-3]}" for n in re.findall(r"`([a-z_]+\.py)`", cells[-2])]
    return names


def test_the_pure_cores_the_architecture_names_import_no_django_and_no_models() -> None:
    cores = pure_cores_in_the_docs()
    assert {"controlplane.rollouts.evaluator", "controlplane.advisor.verdicts"} <= set(cores)
    found = []
    for module in cores:
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{module} imports {n}" for n in names if n.split(".")[0] == "django" or n.endswith(".models")]
    assert found == []


def test_no_workers_module_imports_the_control_plane_or_the_ui() -> None:
    """The data plane runs without Django (architecture.md's process table):
    not one of its modules imports controlplane or dashboards, at the top or
    inside a function."""
    found = []
    for path in sorted((ROOT / "workers").rglob("*.py")):
        module = module_name(path)
        for imp in imports_of(module, path.read_text(), is_package=path.name == "__init__.py"):
            if imp.target.split(".")[0] in ("controlplane", "dashboards"):
                found.append(f"{module}:{imp.line} imports {imp.target}")
    assert found == []
    caught = list(imports_of("workers.bench.x", "def f():\n    from controlplane.metrics import catalogue\n"))
    assert [imp.target for imp in caught] == ["controlplane.metrics.catalogue"]
