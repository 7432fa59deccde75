"""``controlplane.conf.setting``: the one way apps read their tunables."""

from __future__ import annotations

import pytest
from django.test import override_settings

from controlplane.alerts import conf as alerts_conf
from controlplane.conf import setting
from controlplane.gateway import conf as gateway_conf


def test_the_environment_sets_a_tunable_in_the_defaults_type(monkeypatch: pytest.MonkeyPatch) -> None:
    assert setting("CHUNKPILOT_TEST_KNOB", 2.5) == 2.5
    monkeypatch.setenv("CHUNKPILOT_TEST_KNOB", "7")
    assert setting("CHUNKPILOT_TEST_KNOB", 2.5) == 7.0 and isinstance(setting("CHUNKPILOT_TEST_KNOB", 2.5), float)
    assert setting("CHUNKPILOT_TEST_KNOB", 1) == 7
    monkeypatch.setenv("CHUNKPILOT_TEST_KNOB", "off")
    assert setting("CHUNKPILOT_TEST_KNOB", True) is False
    monkeypatch.setenv("CHUNKPILOT_TEST_KNOB", "")
    assert setting("CHUNKPILOT_TEST_KNOB", 3) == 3  # empty means unset


def test_settings_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALERT_DELIVERY_MAX_ATTEMPTS", "9")
    assert alerts_conf.delivery_max_attempts() == 9
    with override_settings(ALERT_DELIVERY_MAX_ATTEMPTS=2):
        assert alerts_conf.delivery_max_attempts() == 2
    monkeypatch.setenv("GATEWAY_MAX_ATTEMPTS", "5")
    assert gateway_conf.get("GATEWAY_MAX_ATTEMPTS") == 5
    with override_settings(GATEWAY_MAX_ATTEMPTS=1):
        assert gateway_conf.get("GATEWAY_MAX_ATTEMPTS") == 1


def test_a_value_of_the_wrong_kind_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_MAX_ATTEMPTS", "three")
    with pytest.raises(ValueError, match="GATEWAY_MAX_ATTEMPTS"):
        gateway_conf.get("GATEWAY_MAX_ATTEMPTS")
