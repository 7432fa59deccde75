"""The shipped Prometheus and Alertmanager files, checked by their own
tools: promtool checks the scrape config and the rules and runs every
rule's unit test (generated beside the rules, see
``controlplane.metrics.rule_tests``), amtool checks the Alertmanager config,
and a real Prometheus parses every expression of the Grafana dashboard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.alerts import models as alert_models
from controlplane.metrics import deploy, rule_tests, shipped
from tests.monitoring import AMTOOL, DEPLOY, PROMTOOL, copy_deploy, prometheus, tool


def shipped_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load((DEPLOY / "prometheus/rules.yml").read_text())["groups"] for r in g["rules"]]


def test_promtool_accepts_the_shipped_scrape_config_with_its_rules_and_token_file(tmp_path: Path) -> None:
    installed = copy_deploy(tmp_path / "deploy") / "prometheus"
    done = tool(PROMTOOL, "check", "config", "prometheus.yml", cwd=installed)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "SUCCESS: 1 rule files found" in done.stdout and f"SUCCESS: {len(shipped_rules())} rules found" in done.stdout
    )


def test_promtool_refuses_the_scrape_config_without_its_token_file(tmp_path: Path) -> None:
    installed = copy_deploy(tmp_path / "deploy") / "prometheus"
    (installed / deploy.TOKEN_FILE).unlink()
    done = tool(PROMTOOL, "check", "config", "prometheus.yml", cwd=installed)
    assert done.returncode != 0 and deploy.TOKEN_FILE in done.stdout + done.stderr


def test_promtool_accepts_the_shipped_rules() -> None:
    done = tool(PROMTOOL, "check", "rules", DEPLOY / "prometheus/rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(shipped_rules())} rules found" in done.stdout


def test_every_shipped_rule_passes_its_promtool_unit_test() -> None:
    done = tool(PROMTOOL, "test", "rules", "rules.test.yml", cwd=DEPLOY / "prometheus")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_shipped_rule_has_a_unit_test() -> None:
    tests = yaml.safe_load((DEPLOY / "prometheus/rules.test.yml").read_text())["tests"]
    checked_exprs = " ".join(check["expr"] for t in tests for check in t.get("promql_expr_test", []))
    alert_checks: dict[str, list[list[Any]]] = {}
    for t in tests:
        for check in t.get("alert_rule_test", []):
            alert_checks.setdefault(check["alertname"], []).append(check["exp_alerts"])
    for rule in shipped_rules():
        if "record" in rule:
            assert f"round({rule['record']} " in checked_exprs, f"recording rule {rule['record']} has no test"
        else:
            checks = alert_checks.get(rule["alert"], [])
            assert [] in checks and any(checks), f"alert {rule['alert']} needs a check that fires and one that does not"


def test_a_rule_without_a_test_stops_the_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    rules_now = deploy.prometheus_rules

    def with_one_more(kind: str, name: str) -> Any:
        def rules() -> dict[str, Any]:
            out = rules_now()
            out["groups"][0 if kind == "record" else 1]["rules"].append({kind: name, "expr": "vector(1)"})
            return out

        return rules

    monkeypatch.setattr(deploy, "prometheus_rules", with_one_more("alert", "ChunkpilotSomethingNew"))
    with pytest.raises(rule_tests.MissingRuleTest, match="ChunkpilotSomethingNew"):
        shipped.files()
    monkeypatch.setattr(deploy, "prometheus_rules", with_one_more("record", "chunkpilot:something_new:5m"))
    with pytest.raises(rule_tests.MissingRuleTest, match="chunkpilot:something_new:5m"):
        shipped.files()


@pytest.mark.parametrize(
    ("original", "broken"),
    [
        (
            "histogram_quantile(0.99, sum by (le, model_name, pool, cohort) (rate(chunkpilot:time_to_first_token",
            "histogram_quantile(0.95, sum by (le, model_name, pool, cohort) (rate(chunkpilot:time_to_first_token",
        ),
        ("chunkpilot:kv_fragmentation:5m > 0.5", "chunkpilot:kv_fragmentation:5m > 0.8"),
        (
            'max by (model_name) (chunkpilot:ttft_p99:5m{cohort="baseline"})',
            'max by (model_name) (chunkpilot:ttft_p99:5m{cohort="stable"})',
        ),
    ],
)
def test_a_rule_changed_without_its_test_fails_the_unit_test(tmp_path: Path, original: str, broken: str) -> None:
    rules = (DEPLOY / "prometheus/rules.yml").read_text()
    assert original in rules
    (tmp_path / "rules.yml").write_text(rules.replace(original, broken))
    (tmp_path / "rules.test.yml").write_text((DEPLOY / "prometheus/rules.test.yml").read_text())
    done = tool(PROMTOOL, "test", "rules", "rules.test.yml", cwd=tmp_path)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


def test_amtool_accepts_the_shipped_alertmanager_config(tmp_path: Path) -> None:
    installed = copy_deploy(tmp_path / "deploy") / "alertmanager"
    done = tool(AMTOOL, "check-config", "alertmanager.yml", cwd=installed)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 receivers" in done.stdout


def test_the_shipped_files_ask_for_the_action_the_webhook_takes() -> None:
    assert (deploy.ACTION_LABEL, deploy.ACTION_ABORT) == (alert_models.ACTION_LABEL, alert_models.ACTION_ABORT)
    config = yaml.safe_load((DEPLOY / "alertmanager/alertmanager.yml").read_text())
    acting = [r for r in config["route"]["routes"] if r["receiver"] == deploy.WEBHOOK_RECEIVER]
    assert acting[0]["matchers"] == [f'{alert_models.ACTION_LABEL}="{alert_models.ACTION_ABORT}"']
    regression = next(r for r in shipped_rules() if r.get("alert") == "ChunkpilotCanaryTTFTRegression")
    assert regression["labels"][alert_models.ACTION_LABEL] == alert_models.ACTION_ABORT


def dashboard_queries() -> list[tuple[str, str]]:
    """Every panel target with each choice of the dashboard's variables
    filled in, as Grafana sends them."""
    dashboard = json.loads((DEPLOY / "grafana/chunkpilot.json").read_text())
    choices = {
        v["name"]: [o["value"] for o in v["options"]] for v in dashboard["templating"]["list"] if v["type"] == "custom"
    }
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for group in choices["group"]:
                for window in choices["window"]:
                    expr = target["expr"].replace("$group", group).replace("$window", window).replace("$pool", ".*")
                    out.append((f"{panel['title']} {target['refId']}", expr))
    return out


@pytest.mark.slow
def test_every_dashboard_expression_parses_in_prometheus(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) > 100
    config = {"global": {"scrape_interval": "1m"}, "scrape_configs": []}
    with prometheus(tmp_path / "prometheus", config) as prom:
        for title, expr in queries:
            reply = prom.http.get("/api/v1/query", params={"query": expr})
            assert reply.status_code == 200 and reply.json()["status"] == "success", (title, expr, reply.text)
        assert prom.http.get("/api/v1/query", params={"query": "sum by (le (x)"}).status_code == 400
