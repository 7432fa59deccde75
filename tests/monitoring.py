"""Debian's Prometheus and Alertmanager as test processes, run with the
shipped configs from ``deploy/`` templated for the test (the control
plane's URL, a token file, short intervals).

The binaries are a requirement of the suite like PostgreSQL: ``make test``
installs them when run as root, and a missing one fails the test that needs
it (in CI or not), never skips it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from controlplane.metrics import deploy
from tests.support import ROOT, Process, free_port, running

DEPLOY = ROOT / "deploy"
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
AMTOOL = "/usr/bin/amtool"
_PACKAGES = {
    PROMETHEUS: "prometheus",
    PROMTOOL: "prometheus",
    ALERTMANAGER: "prometheus-alertmanager",
    AMTOOL: "prometheus-alertmanager",
}


def binary(path: str) -> str:
    if not Path(path).exists():
        raise RuntimeError(f"{path} is missing: apt-get install {_PACKAGES[path]} (make test does, as root)")
    return path


def tool(path: str, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """promtool or amtool, its output kept for the assertion message."""
    return subprocess.run([binary(path), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


# ---- the shipped configs, templated --------------------------------------------------------


def prometheus_config(
    *,
    control_plane: str,
    scrape_interval: str = "1s",
    alertmanager: str | None = None,
    rule_files: list[str] | None = None,
) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml pointed at a control plane, with
    short intervals: the SD URL, the control plane's own target and scheme,
    and the Alertmanager (none: no alerting section)."""
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    config["global"].update(
        scrape_interval=scrape_interval, scrape_timeout=scrape_interval, evaluation_interval=scrape_interval
    )
    url = urlsplit(control_plane)
    for job in config["scrape_configs"]:
        job["scrape_interval"] = scrape_interval
        if job["job_name"] == deploy.WORKERS_JOB:
            (sd,) = job["http_sd_configs"]
            assert sd["url"] == deploy.EXAMPLE_URL + deploy.SD_PATH
            sd.update(url=control_plane + deploy.SD_PATH, refresh_interval="1s")
        elif job["job_name"] == deploy.CONTROL_PLANE_JOB:
            job["scheme"] = url.scheme
            job["static_configs"] = [{"targets": [url.netloc]}]
    if alertmanager is None:
        config.pop("alerting")
    else:
        config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [urlsplit(alertmanager).netloc]}]}]
    if rule_files is not None:
        config["rule_files"] = rule_files
    return config


def alertmanager_config(
    *, control_plane: str, group_interval: str = "1s", repeat_interval: str = "2s"
) -> dict[str, Any]:
    """deploy/alertmanager/alertmanager.yml pointed at a control plane's
    webhook, with the acting route's intervals short."""
    config = yaml.safe_load((DEPLOY / "alertmanager/alertmanager.yml").read_text())
    (receiver,) = [r for r in config["receivers"] if r["name"] == deploy.WEBHOOK_RECEIVER]
    (hook,) = receiver["webhook_configs"]
    assert hook["url"] == deploy.EXAMPLE_URL + deploy.WEBHOOK_PATH
    hook["url"] = control_plane + deploy.WEBHOOK_PATH
    (acting,) = [r for r in config["route"]["routes"] if r["receiver"] == deploy.WEBHOOK_RECEIVER]
    acting.update(group_interval=group_interval, repeat_interval=repeat_interval)
    return config


def short_rules(window: str | None = None, for_: str | None = None) -> str:
    """The shipped rules evaluated at the test's evaluation_interval, with
    every range and ``for:`` shortened when asked, for a test that cannot
    wait five minutes; the record names keep their ``:5m``."""
    rules = yaml.safe_load((DEPLOY / "prometheus/rules.yml").read_text())
    for group in rules["groups"]:
        group.pop("interval", None)
        for rule in group["rules"]:
            if window is not None:
                rule["expr"] = re.sub(rf"\[{deploy.RULE_WINDOW}\]", f"[{window}]", rule["expr"])
            if for_ is not None and "for" in rule:
                rule["for"] = for_
    return yaml.safe_dump(rules, sort_keys=False, width=120, allow_unicode=True)


# ---- processes --------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, proc: Process, url: str):
        self.proc, self.url = proc, url
        self.http = httpx.Client(base_url=url, timeout=30)

    def api(self, path: str, **params: Any) -> Any:
        reply = self.http.get(f"/api/v1/{path}", params=params)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: [{"metric": {...}, "value": [t, "v"]}]."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def by(self, label: str, expr: str, at: float | None = None) -> dict[str, float]:
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in self.query(expr, at)}

    def active_targets(self, job: str) -> list[dict[str, Any]]:
        return [t for t in self.api("targets")["activeTargets"] if t["labels"].get("job") == job]


class Alertmanager:
    def __init__(self, proc: Process, url: str):
        self.proc, self.url = proc, url
        self.http = httpx.Client(base_url=url, timeout=30)

    def alerts(self, **params: Any) -> list[dict[str, Any]]:
        reply = self.http.get("/api/v2/alerts", params=params)
        assert reply.status_code == 200, reply.text
        return list(reply.json())

    def notifications(self, integration: str = "webhook") -> float:
        """How many notifications it has sent through an integration."""
        text = self.http.get("/metrics").text
        pattern = rf'^alertmanager_notifications_total\{{[^}}]*integration="{integration}"[^}}]*\}} (\S+)$'
        return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def _write(directory: Path, name: str, config: Mapping[str, Any], files: Mapping[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for file_name, text in files.items():
        (directory / file_name).write_text(text)
    path = directory / name
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    return path


@contextlib.contextmanager
def prometheus(
    directory: Path,
    config: Mapping[str, Any],
    files: Mapping[str, str] | None = None,
    *,
    alert_resend_delay: str = "1s",
) -> Iterator[Prometheus]:
    """Prometheus on a free port with this config and the files beside it
    (rules, the token file), its data in ``directory``."""
    path = _write(directory, "prometheus.yml", config, files or {})
    port = free_port()
    argv = [
        binary(PROMETHEUS),
        f"--config.file={path}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--rules.alert.resend-delay={alert_resend_delay}",
        "--log.level=warn",
    ]
    url = f"http://127.0.0.1:{port}"
    with running(argv, log_path=directory / "prometheus.log") as proc:
        proc.wait_http(f"{url}/-/ready", timeout=60)
        yield Prometheus(proc, url)


@contextlib.contextmanager
def alertmanager(
    directory: Path, config: Mapping[str, Any], files: Mapping[str, str] | None = None
) -> Iterator[Alertmanager]:
    """Alertmanager on a free port, alone (no cluster: no gossip port)."""
    path = _write(directory, "alertmanager.yml", config, files or {})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        binary(ALERTMANAGER),
        f"--config.file={path}",
        f"--storage.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
    ]
    with running(argv, log_path=directory / "alertmanager.log") as proc:
        proc.wait_http(f"{url}/-/ready", timeout=60)
        yield Alertmanager(proc, url)


def copy_deploy(directory: Path, token: str = "test-token") -> Path:
    """deploy/ copied with a token file beside each config, as an operator installs it."""
    shutil.copytree(DEPLOY, directory)
    for config_dir in ("prometheus", "alertmanager"):
        (directory / config_dir / deploy.TOKEN_FILE).write_text(token)
    return directory
