"""``controlplane.conf``: the one way apps declare and read their tunables, and
README.md's two tables of variables, kept equal to what the code reads."""

from __future__ import annotations

import ast
import re

import pytest
from django.test import override_settings

from controlplane.alerts import conf as alerts_conf
from controlplane.conf import Tunable, all_tunables, markdown_table
from controlplane.gateway import conf as gateway_conf
from tests.support import ROOT

KNOB = Tunable("CHUNKPILOT_TEST_KNOB", 2.5, "a knob for this test")
WHOLE_KNOB = Tunable("CHUNKPILOT_TEST_KNOB", 1, "the same knob, read as an int")
SWITCH = Tunable("CHUNKPILOT_TEST_KNOB", True, "the same knob, read as a switch")
TUNABLES_BEGIN = "<!-- tunables: generated from each app's conf.py by controlplane.conf.markdown_table() -->"
TUNABLES_END = "<!-- /tunables -->"


def test_the_environment_sets_a_tunable_in_the_defaults_type(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KNOB.get() == 2.5
    monkeypatch.setenv("CHUNKPILOT_TEST_KNOB", "7")
    assert KNOB.get() == 7.0 and isinstance(KNOB.get(), float)
    assert WHOLE_KNOB.get() == 7
    monkeypatch.setenv("CHUNKPILOT_TEST_KNOB", "off")
    assert SWITCH.get() is False
    monkeypatch.setenv("CHUNKPILOT_TEST_KNOB", "")
    assert WHOLE_KNOB.get() == 1  # empty means unset


def test_settings_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALERT_DELIVERY_MAX_ATTEMPTS", "9")
    assert alerts_conf.ALERT_DELIVERY_MAX_ATTEMPTS.get() == 9
    with override_settings(ALERT_DELIVERY_MAX_ATTEMPTS=2):
        assert alerts_conf.ALERT_DELIVERY_MAX_ATTEMPTS.get() == 2
    monkeypatch.setenv("GATEWAY_MAX_ATTEMPTS", "5")
    assert gateway_conf.GATEWAY_MAX_ATTEMPTS.get() == 5
    with override_settings(GATEWAY_MAX_ATTEMPTS=1):
        assert gateway_conf.GATEWAY_MAX_ATTEMPTS.get() == 1


def test_a_value_of_the_wrong_kind_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_MAX_ATTEMPTS", "three")
    with pytest.raises(ValueError, match="GATEWAY_MAX_ATTEMPTS"):
        gateway_conf.GATEWAY_MAX_ATTEMPTS.get()


def test_a_computed_default_follows_what_it_is_computed_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALERT_DISPATCH_INTERVAL", raising=False)
    with override_settings(ALERT_EVAL_INTERVAL=2.0):
        assert alerts_conf.ALERT_DISPATCH_INTERVAL.get() == 2.0
    with override_settings(ALERT_EVAL_INTERVAL=60.0):
        assert alerts_conf.ALERT_DISPATCH_INTERVAL.get() == 5.0
    with override_settings(ALERT_EVAL_INTERVAL=60.0, ALERT_DISPATCH_INTERVAL=1.5):
        assert alerts_conf.ALERT_DISPATCH_INTERVAL.get() == 1.5


def test_a_computed_default_must_say_its_type_and_how_the_readme_shows_it() -> None:
    with pytest.raises(TypeError, match="CHUNKPILOT_TEST_KNOB"):
        Tunable("CHUNKPILOT_TEST_KNOB", lambda: 1.0, "computed, but of no declared type")


def test_every_tunable_is_declared_once_bound_to_its_own_name() -> None:
    names = [t.name for t in all_tunables()]
    assert len(names) == len(set(names))
    # Every app with tunables is found, not only the ones that had a conf.py before.
    assert {
        "HEARTBEAT_INTERVAL_SECONDS",
        "SCRAPE_INTERVAL",
        "ALERT_EVAL_INTERVAL",
        "GATEWAY_POLL_SECONDS",
        "ROLLOUT_ACK_WAIT_SECONDS",
    } <= set(names)


def test_the_readme_lists_every_tunable_as_declared() -> None:
    readme = (ROOT / "README.md").read_text()
    assert TUNABLES_BEGIN in readme and TUNABLES_END in readme
    shown = readme.split(TUNABLES_BEGIN, 1)[1].split(TUNABLES_END, 1)[0].strip()
    expected = markdown_table(all_tunables())
    assert shown == expected, f"README.md's tunables table is stale; replace it with:\n{expected}"


def _variables_read_by_the_code() -> set[str]:
    """Every environment variable a control-plane module reads by a literal
    name: settings.py's env_* helpers, os.environ.get and os.getenv."""
    readers = {"env_str", "env_bool", "env_int", "env_float", "env_list", "os.environ.get", "os.getenv"}
    names = set()
    for path in (ROOT / "controlplane").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in readers
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def test_the_readme_lists_every_deployment_variable_the_code_reads_and_no_other() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment", 1)[1].split(TUNABLES_BEGIN, 1)[0]
    listed = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            listed |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    assert listed == _variables_read_by_the_code()
